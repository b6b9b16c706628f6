#!/usr/bin/env bash
# Rate against distortion of every codec of the leader's top-k positions (lgc-bench codecs): on
# recorded Fashion-MNIST gradients (ResNet-8, IID) of 2, 4 and 8 workers at 8 and 32 images per
# worker, 40 steps each (the first 20 fit PCA and train the autoencoders, the last 20 are scored),
# density 1 %, chunks of 64, fixed and rotating leader. Writes OUT/codecs.md, codecs.json and
# codecs.png (error of the delivered sum against wire bits per value, positions included).
#   experiments/codecs_rate_distortion.sh [OUT]
#   DATA=digits WORKERS=2,4 BATCH_SIZES=32 experiments/codecs_rate_distortion.sh
# Needs the dataset for DATA=fashion_mnist: apt-get install dataset-fashion-mnist (or FASHION_MNIST_ROOT).
set -euo pipefail
out=${1:-experiments/results/codecs}
lgc-bench codecs --data "${DATA:-fashion_mnist}" --workers "${WORKERS:-2,4,8}" --batch-sizes "${BATCH_SIZES:-8,32}" \
  --steps "${STEPS:-40}" --density "${DENSITY:-0.01}" --chunk 64 --out "$out"
