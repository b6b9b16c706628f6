#!/usr/bin/env bash
# LGC's ablation: does LGC's autoencoder beat simpler codecs that share its leader's positions?
# On the embedded task made harder (non-IID: each class split among the workers in Dirichlet(0.3)
# proportions) and longer (46 epochs, about 1,000 steps of 64 images in all, so warm-up is a small
# part of the run), with 2 and 8 worker processes and two densities:
#   dense, PyTorch's fp16 hook, PowerSGD, top-k, DGC, LGC-RAR, LGC-PS, LGC-RAR with the linear codec,
#   shared-index top-k (fp32, fp16, int8, and int4 where the 4-bit lanes hold the workers' sum),
#   and leader-scaled.
# LGC and the shared-index codecs run with measure_error (the error of the sums they deliver at the
# leader's positions against the exact sums; an extra allreduce that is not counted in the bytes).
# Then lgc-report: accuracy, whole-run wire MB per worker, x fewer bytes than DGC (same workers and
# density), LGC's compressed-stage ratio and the error, in OUT/report/.
#   WORKERS="2 8" DENSITIES="0.01 0.001" EPOCHS=46 experiments/lgc_ablation.sh [OUT]
set -euo pipefail
out=${1:-outputs/lgc_ablation}
epochs=${EPOCHS:-46}
common=(data.partition=dirichlet data.alpha=0.3 "trainer.max_epochs=$epochs" "scheduler.T_max=$epochs"
        logger=csv trainer.enable_progress_bar=false ddp.oversubscribe=true)
for workers in ${WORKERS:-2 8}; do
  batch=$((64 / workers))
  run() {
    local name=$1; shift
    [ -f "$out/w$workers/$name/summary.json" ] && return  # done already: the script resumes where it stopped
    lgc-train "${common[@]}" "trainer.devices=$workers" "data.batch_size=$batch" output_dir="$out/w$workers/$name" "$@"
  }
  run dense experiment=embedded/dense
  run fp16 compressor=torch_fp16
  run powersgd experiment=embedded/powersgd
  for density in ${DENSITIES:-0.01 0.001}; do
    d=(compressor.density="$density")
    run "topk_$density" experiment=embedded/topk "${d[@]}"
    run "dgc_$density" experiment=embedded/dgc_1pct "${d[@]}"
    run "lgc_rar_$density" experiment=embedded/lgc_rar "${d[@]}" compressor.measure_error=true
    run "lgc_ps_$density" experiment=embedded/lgc_ps "${d[@]}" compressor.measure_error=true \
      compressor.innovation_density="$(python -c "print($density / 10)")"
    run "lgc_rar_linear_$density" experiment=embedded/lgc_rar_linear "${d[@]}"
    run "shared_fp32_$density" experiment=embedded/shared_topk "${d[@]}"
    run "shared_fp16_$density" experiment=embedded/shared_topk "${d[@]}" compressor.values=float16
    run "shared_int8_$density" experiment=embedded/shared_topk_int8 "${d[@]}"
    if [ "$workers" -le 7 ]; then
      run "shared_int4_$density" experiment=embedded/shared_topk "${d[@]}" compressor.values=int4
    fi
    run "leader_scaled_$density" experiment=embedded/leader_scaled "${d[@]}"
  done
done
lgc-report "$out" --out "$out/report"
