#!/usr/bin/env bash
# What a method costs inside a sharded step beside the same method under DDP: lgc-bench step (ResNet-50
# shapes, gloo workers on this machine, one thread each, interleaved rounds) at density 1 % for the
# methods of the sharded comparison (dense, fp16, top-k with error feedback, QSGD), each under DDP and
# sharded, with DDP's own allreduce step and the sharded strategy's own step as the references every
# row is divided by. Needs a quiet machine.
#   fsdp: 2 workers, FSDP2 (fully_shard on every block) beside FSDP2's own reduce-scatter; about 15 min;
#         writes OUT/step_0.01.{md,json}.
#   hsdp: 4 workers as 2 replicas of 2 (the sharded comparison's mesh), lgc's all-reduce across the
#         replicas beside FSDP2's own HSDP; 4 workers share the 2 cores, so read its ratios, not its
#         times; writes OUT/step_0.01_hsdp.{md,json}.
#   experiments/sharded_step_cost.sh [OUT] [fsdp|hsdp|both]   (default: both)
set -euo pipefail
out=${1:-experiments/results/sharded_step_cost}
which=${2:-both}
mkdir -p "$out"
if [ "$which" = fsdp ] || [ "$which" = both ]; then
  lgc-bench step --density 0.01 --steps 4 --rounds 5 --methods ddp,none,fp16,topk,qsgd \
    --fsdp fsdp,none,fp16,topk,qsgd --json "$out/step_0.01.json" | tee "$out/step_0.01.md"
fi
if [ "$which" = hsdp ] || [ "$which" = both ]; then
  lgc-bench step --density 0.01 --steps 4 --rounds 5 --workers 4 --shard-size 2 --methods ddp,none,fp16,topk,qsgd \
    --hsdp hsdp,none,fp16,topk,qsgd --json "$out/step_0.01_hsdp.json" | tee "$out/step_0.01_hsdp.md"
fi
