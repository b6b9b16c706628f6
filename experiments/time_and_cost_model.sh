#!/usr/bin/env bash
# Time, not just bytes. Needs root and iproute2 (network namespaces, veth, tc).
#  1. Every method over a real shaped network, 2 and 4 workers x 100 Mbit/s and 1 Gbit/s: step time
#     split into compute / encode / decode / communication, wire bytes against the interfaces'
#     counters, time to 95 % validation accuracy, and the cost model's prediction of every step
#     against the measured one (the link fitted on plain collectives first).
#  2. The cost model where we cannot run: ResNet-50 and ResNet-101 shapes at 8 / 64 / 512 workers x
#     1 / 10 / 100 Gbit/s, with this machine's encode/decode time and with a free codec, and the
#     bandwidth below which each method beats the fp16 hook and dense.
# About 25 minutes on 2 cores, most of it step 1.
set -euo pipefail
out=${1:-outputs/time_and_cost_model}
mkdir -p "$out"
lgc-bench network --workers 2,4 --bandwidth 100mbit,1gbit --steps 200 --eval-every 10 --target 0.95 \
  --out "$out/network"
for codec in measured free; do
  lgc-bench model --model resnet50,resnet101 --workers 8,64,512 --bandwidth 1gbit,10gbit,100gbit \
    --codec $codec --profiles "$out/profiles.json" --out "$out/model_codec_$codec"
done
