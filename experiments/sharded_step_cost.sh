#!/usr/bin/env bash
# What a method costs inside a sharded step beside the same method under DDP: lgc-bench step (ResNet-50
# shapes, 2 gloo workers on this machine, one thread each, interleaved rounds) at density 1 % for the
# methods of the sharded comparison (dense, fp16, top-k with error feedback, QSGD), each under DDP and
# under FSDP2 (fully_shard on every block), with DDP's own allreduce step and FSDP2's own
# reduce-scatter step as the references every row is divided by. Needs a quiet machine and about
# 15 min; writes OUT/step_0.01.{md,json}.
#   experiments/sharded_step_cost.sh [OUT]
set -euo pipefail
out=${1:-experiments/results/sharded_step_cost}
mkdir -p "$out"
lgc-bench step --density 0.01 --steps 4 --rounds 5 --methods ddp,none,fp16,topk,qsgd \
  --fsdp fsdp,none,fp16,topk,qsgd --json "$out/step_0.01.json" | tee "$out/step_0.01.md"
