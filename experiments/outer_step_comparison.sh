#!/usr/bin/env bash
# Per-step compression (DGC, LGC, shared-index int8) against
# local-step methods (SBC with delay, DiLoCo H = 10 and 50, Streaming DiLoCo with 4-bit outer
# gradients, SparseLoCo H = 10) and DeMo, at equal steps, on two stages:
#   1. lgc-bench network: 4 workers, each link shaped to 100 Mbit/s, digits ResNet-8, STEPS steps;
#      time to the target accuracy, whole-run wire MB, accuracy at equal wire bytes, and the plots of
#      accuracy against wall time and against wire bytes (OUT/network/accuracy_vs_time.png).
#   2. lgc-train on the embedded task (the main job: 2 workers, 330 steps), then lgc-report
#      (OUT/embedded/report: accuracy against whole-run wire bytes).
# Needs root for the shaped network (stage 1); STAGES=2 runs only the second.
#   STEPS=200 experiments/outer_step_comparison.sh [OUT]
set -euo pipefail
out=${1:-outputs/outer_step_comparison}
steps=${STEPS:-200}
if [[ "${STAGES:-1 2}" == *1* ]]; then
  methods="none,dgc,sbc:delay=4,lgc_rar,shared_topk_int8,none:delay=10;outer=sgd,none:delay=50;outer=sgd"
  methods+=",sparseloco:delay=10,demo:lr=0.003,fp4:delay=10;outer=sgd;fragments=2"
  lgc-bench network --workers 4 --bandwidth 100mbit --steps "$steps" --eval-every 10 --target 0.9 \
    --methods "$methods" --out "$out/network"
fi
if [[ "${STAGES:-1 2}" == *2* ]]; then
  common=(logger=csv trainer.enable_progress_bar=false)
  run() {
    local name=$1; shift
    [ -f "$out/embedded/$name/summary.json" ] && return  # done already: the script resumes where it stopped
    lgc-train "${common[@]}" output_dir="$out/embedded/$name" "$@"
  }
  run dense experiment=embedded/dense
  run dgc experiment=embedded/dgc
  run sbc_delay4 experiment=embedded/sbc_delay
  run lgc_rar experiment=embedded/lgc_rar
  run shared_topk_int8 experiment=embedded/shared_topk_int8
  run diloco_h10 experiment=diloco
  run diloco_h50 experiment=diloco comm.delay=50
  run diloco_h10_streaming experiment=diloco comm=streaming_diloco comm.fragments=2
  run streaming_diloco experiment=streaming_diloco
  run sparseloco_h10 experiment=sparseloco
  run sparseloco_h50 experiment=sparseloco comm.delay=50
  run demo experiment=demo
  lgc-report "$out/embedded" --out "$out/embedded/report"
fi
