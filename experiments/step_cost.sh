#!/usr/bin/env bash
# What each method's hook costs inside a real DDP step, as a multiple of the no-communication step:
# lgc-bench step (ResNet-50 shapes, 2 gloo workers on this machine, one thread each, interleaved
# rounds) at densities 0.1 % and 1 %, for the methods of the Fashion-MNIST comparison (docs/evidence.md; its rule for
# lgc-train's default admits methods whose step costs at most 1.25x DDP's own step;
# experiments/default_rule.py reads these tables). Methods with communication delay (SBC,
# shared-index int8 and LGC-RAR's lean codec with delay 4, SparseLoCo and DiLoCo with H = 10) are read
# by their mean step: 20 timed steps each (2 rounds x 10), a multiple of every delay; DiLoCo with
# H = 50 exchanges 5x less often than with H = 10, whose row bounds its cost. Every method keeps a
# ResNet-50 and its state in each worker for the interleaved rounds (all in one run exceeds 24 GB
# at 1 %), so the methods are timed in groups, each run with DDP's row again (the rule reads each
# row over its own run's DDP row). Needs a quiet machine (timings) and about 8 min per group and
# density; writes OUT/step_DENSITY[_GROUP].{md,json} (the main group without a suffix).
#   [STEP_GROUPS="main more lean quant"] [DENSITIES="0.001 0.01"] experiments/step_cost.sh [OUT]
set -euo pipefail
out=${1:-experiments/results/step_cost}
mkdir -p "$out"
# LGC-RAR's lean codec (experiment=embedded/lgc_rar_lean).
lean="lgc_rar:training.codec=linear;latent_dtype=int8;leaders.index_coding=golomb;leaders.value_order=position"
declare -A group=(
  [main]="ddp,none,torch_fp16,powersgd,topk,dgc,sbc,redsync,shared_topk_int8,lgc_rar,demo,sbc:delay=4,sbc:delay=4;min_numel=0,sparseloco:delay=10"
  [more]="ddp,fp16,signsgd,shared_topk:values=int8;measure_error=true,shared_topk:values=float16;measure_error=false,lgc_rar:training.codec=linear,none:delay=10;outer=sgd"
  [lean]="ddp,shared_topk_int8:delay=4,$lean,$lean;delay=4,$lean;delay=4;min_numel=0"
  [quant]="ddp,qsgd,terngrad,random_block:shared=true,lgc_ps"
)
groups=${STEP_GROUPS:-main more lean quant}
for g in $groups; do
  [[ -v "group[$g]" ]] || { echo "unknown group $g (main, more, lean, quant)" >&2; exit 2; }
done
for density in ${DENSITIES:-0.001 0.01}; do
  for g in $groups; do
    suffix=${g#main}; suffix=${suffix:+_$suffix}
    lgc-bench step --density "$density" --steps 10 --rounds 2 --methods "${group[$g]}" \
      --json "$out/step_${density}${suffix}.json" | tee "$out/step_${density}${suffix}.md"
  done
done
