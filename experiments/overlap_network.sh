#!/usr/bin/env bash
# The hook's overlap over a real shaped network: top-k at density 1 % with error feedback, held to
# the step's last bucket against encoded and sent bucket by bucket (comm.overlap), on ResNet-18
# (11 M parameters in several DDP buckets; a ResNet-8 fits one bucket, where overlap cannot help),
# 4 workers, 100 Mbit/s and 1 Gbit/s per link, 30 steps, seeds 0-2 (methods in a rotated order
# per seed). Training is bitwise the same with and without overlap, so only the step time moves.
# Needs root and iproute2 (lgc-bench network makes one network namespace per worker).
#   experiments/overlap_network.sh [OUT]
set -euo pipefail
out=${1:-experiments/results/overlap}
lgc-bench network --task resnet18 --workers 4 --bandwidth "${BANDWIDTH:-100mbit,1gbit}" \
  --methods 'topk:density=0.01,topk:density=0.01;overlap=true' --steps "${STEPS:-30}" --eval-every 1000 \
  --skip 5 --seeds "${SEEDS:-0,1,2}" --out "$out"
