#!/usr/bin/env bash
# What each method's hook costs inside a real DDP step, as a multiple of the no-communication step:
# lgc-bench step (ResNet-50 shapes, 2 gloo workers on this machine, one thread each, interleaved
# rounds) at densities 0.1 % and 1 %, for the methods the README's comparison recommends or weighs
# (its rule for lgc-train's default admits methods whose step costs at most 1.25x DDP's own step;
# experiments/default_rule.py reads these tables). Methods with communication delay (SBC with
# delay 4, SparseLoCo and DiLoCo with H = 10) are read by their mean step: 20 timed steps each
# (2 rounds x 10), a multiple of every delay; DiLoCo with H = 50 exchanges 5x less often than
# with H = 10, whose row bounds its cost. Needs a quiet machine (timings) and about 30 min; writes
# OUT/step_DENSITY.{md,json} and OUT/step_DENSITY_more.{md,json}.
#   experiments/step_cost.sh [OUT]
set -euo pipefail
out=${1:-experiments/results/step_cost}
mkdir -p "$out"
methods="ddp,none,torch_fp16,powersgd,topk,dgc,sbc,redsync,shared_topk_int8,lgc_rar,demo"
methods+=",sbc:delay=4,sbc:delay=4;min_numel=0,sparseloco:delay=10"
# The rows the rule also needs, in a run of their own (every method keeps a ResNet-50 and its state
# in each worker for the interleaved rounds: all in one run exceeds 24 GB at 1 %), DDP's row again.
more="ddp,fp16,signsgd,shared_topk:values=int8;measure_error=true,shared_topk:values=float16;measure_error=false"
more+=",lgc_rar:codec=linear,none:delay=10;outer=sgd"
for density in ${DENSITIES:-0.001 0.01}; do
  lgc-bench step --density "$density" --steps 10 --rounds 2 --methods "$methods" \
    --json "$out/step_$density.json" | tee "$out/step_$density.md"
  lgc-bench step --density "$density" --steps 10 --rounds 2 --methods "$more" \
    --json "$out/step_${density}_more.json" | tee "$out/step_${density}_more.md"
done
