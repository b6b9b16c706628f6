#!/usr/bin/env bash
# The comparison: dense, DGC (1 %), LGC-PS and LGC-RAR (leader top-k at 1 %) on the embedded
# task with 2 and with 8 worker processes, the same seed and the same step budget: 64 images per
# step in all (32 per worker with 2 workers, 8 per worker with 8), 22 steps per epoch, 15 epochs.
set -euo pipefail
out=${1:-outputs/lgc_embedded}
for workers in 2 8; do
  batch=$((64 / workers))
  for name in dense dgc_1pct lgc_ps lgc_rar lgc_rar_compact; do
    lgc-train experiment=embedded/$name trainer.devices=$workers ddp.oversubscribe=true data.batch_size=$batch \
      logger=csv trainer.enable_progress_bar=false output_dir="$out/w$workers/$name"
  done
done
lgc-report "$out" --out "$out/report"
