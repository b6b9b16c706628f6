#!/usr/bin/env bash
# Streaming DiLoCo's overlap over a real shaped network, on the task that separates methods:
# Fashion-MNIST, ResNet-8, 4 workers (each in its own network namespace, links shaped by tc) at
# 100 Mbit/s and 1 Gbit/s, seeds 0-2, STEPS steps evaluated every 50 on the 10,000 test images.
# Streaming DiLoCo as experiment=streaming_diloco runs it (H = 10, 2 strided fragments, outer
# Nesterov SGD 0.7 / 0.9, outer gradients in fp4), its exchange blocking at its turn (tau 0) and
# started 1 and 4 local steps earlier (tau 1, 4; the gap between two fragments' turns is 5), the
# overlapped steps' progress dropped (alpha 0, torchft's default) or half kept (alpha 0.5), beside
# dense, PyTorch's fp16 hook and DiLoCo H = 10 (one fragment, exact): time to TARGET with its 95 %
# interval as a multiple of the no-communication bound, step time, wire bytes and final accuracy.
# Resumable: lgc-bench network keeps every measurement in OUT/network.json.gz as it arrives and a
# rerun skips what is there. Needs root and iproute2, and a quiet machine (timings).
#   sudo experiments/streaming_overlap_network.sh [OUT]
#   STEPS=600 BANDWIDTHS=100mbit sudo experiments/streaming_overlap_network.sh
# Needs the dataset: apt-get install dataset-fashion-mnist (or FASHION_MNIST_ROOT).
set -euo pipefail
out=${1:-experiments/results/streaming_overlap_network}
streaming="fp4:delay=10;outer=sgd;fragments=2;fragment_split=strided"
methods="none,torch_fp16,none:delay=10;outer=sgd,$streaming,$streaming;overlap_steps=1,$streaming;overlap_steps=4"
methods+=",$streaming;overlap_steps=4;mixing=0.5"
lgc-bench network --task fashion_mnist --workers 4 --bandwidth "${BANDWIDTHS:-100mbit,1gbit}" \
  --seeds "${SEEDS:-0,1,2}" --steps "${STEPS:-1000}" --eval-every 50 --target "${TARGET:-0.86}" \
  --methods "$methods" --out "$out"
