#!/usr/bin/env bash
# LGC's levers, one at a time, on the ablation's task (experiments/lgc_ablation.sh:
# non-IID Dirichlet 0.3, 46 epochs, about 1,000 steps) with 8 workers, beside the same levers on the
# best simple codecs (shared-index top-k, fp16 and int8 values), so each kept lever has its row:
#   w1      one dense warm-up step instead of 30 (the warm-up was half of LGC's whole-run bytes)
#   golomb  Golomb-coded leader positions (SBC's code; needs leaders.value_order=position)
#   fp16    fp16 latents on the wire
#   narrow  a 12x cheaper autoencoder (widths 16-32-64-16 / 16-32-32-16)
#   init    the codec of the lgc_rar_w1 run, loaded with training.autoencoder.init, no codec-training stage
# Runs land beside the ablation's (OUT/w8/...), so one lgc-report shows them all.
#   WORKERS=8 DENSITIES=0.01 EPOCHS=46 experiments/lgc_levers.sh [OUT]
set -euo pipefail
out=${1:-outputs/lgc_ablation}
epochs=${EPOCHS:-46}
common=(data.partition=dirichlet data.alpha=0.3 "trainer.max_epochs=$epochs" "scheduler.T_max=$epochs"
        logger=csv trainer.enable_progress_bar=false ddp.oversubscribe=true)
narrow=(compressor.training.autoencoder.encoder_channels=[16,32,64,16] compressor.training.autoencoder.decoder_channels=[16,32,32,16])
golomb=(compressor.leaders.index_coding=golomb compressor.leaders.value_order=position)
for workers in ${WORKERS:-8}; do
  batch=$((64 / workers))
  run() {
    local name=$1; shift
    [ -f "$out/w$workers/$name/summary.json" ] && return  # done already: the script resumes where it stopped
    lgc-train "${common[@]}" "trainer.devices=$workers" "data.batch_size=$batch" output_dir="$out/w$workers/$name" "$@"
  }
  for density in ${DENSITIES:-0.01}; do
    d=(compressor.density="$density" compressor.stages.warmup_steps=1)
    lgc=(experiment=embedded/lgc_rar "${d[@]}" compressor.measure_error=true)
    run "lgc_rar_w1_$density" "${lgc[@]}"
    run "shared_fp16_w1_$density" experiment=embedded/shared_topk "${d[@]}" compressor.values=float16
    run "shared_int8_w1_$density" experiment=embedded/shared_topk_int8 "${d[@]}"
    run "lgc_rar_w1_golomb_fp16_$density" "${lgc[@]}" "${golomb[@]}" compressor.latent_dtype=float16
    run "shared_int8_w1_golomb_$density" experiment=embedded/shared_topk_int8 "${d[@]}" "${golomb[@]}"
    run "lgc_rar_w1_narrow_$density" "${lgc[@]}" "${narrow[@]}"
    run "lgc_rar_w1_init_$density" "${lgc[@]}" compressor.stages.ae_steps=0 \
      "compressor.training.autoencoder.init=$out/w$workers/lgc_rar_w1_$density/codec.pt"
  done
done
lgc-report "$out" --out "$out/report"
