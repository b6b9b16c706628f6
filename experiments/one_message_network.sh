#!/usr/bin/env bash
# Time to accuracy at 100 Mbit/s of the per-step methods whose steps one message per step and the
# bucket codecs were built to shorten (DGC, shared-index int8, LGC-RAR), beside dense and PyTorch's
# fp16 hook, in the setting of experiments/fashion_mnist_network.sh (Fashion-MNIST, ResNet-8, 4
# workers each in its own network namespace behind a 100 Mbit/s link, seeds 0-2, 1000 steps
# evaluated every 50 on the 10,000 test images, cosine to 0, target 0.86), whose committed run is
# the "before". Then a table of each method's time to the target as a multiple of the
# no-communication bound (95 % intervals over the seeds), before and after, and its median step.
# Resumable (lgc-bench network keeps every measurement in OUT/network.json.gz as it arrives).
# Needs root, iproute2 and a quiet machine (timings), about 45 min.
#   sudo experiments/one_message_network.sh [OUT] [BEFORE]
# Needs the dataset: apt-get install dataset-fashion-mnist (or FASHION_MNIST_ROOT).
set -euo pipefail
out=${1:-experiments/results/one_message_network}
before=${2:-experiments/results/fashion_mnist_network}
lgc-bench network --task fashion_mnist --workers 4 --bandwidth 100mbit --seeds "${SEEDS:-0,1,2}" --steps 1000 \
  --eval-every 50 --target 0.86 --methods "none,torch_fp16,dgc:steps_per_epoch=6,shared_topk_int8,lgc_rar" \
  --out "$out"
python experiments/one_message_tables.py time "$before/network.json.gz" "$out/network.json.gz" \
  --setting "4 workers, 100mbit" --commit "$(git rev-parse --short HEAD)" --write
