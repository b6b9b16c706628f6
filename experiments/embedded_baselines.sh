#!/usr/bin/env bash
# Every method on the embedded task (digits, ResNet-8, 2 CPU workers), then one comparison table.
set -euo pipefail
out=${1:-outputs/embedded_baselines}
for name in dense fp16 topk dgc dgc_1pct sbc sbc_delay redsync_trimmed redsync_search random_block \
            random_block_unshared qsgd terngrad signsgd powersgd lgc_rar lgc_rar_compact lgc_ps; do
  lgc-train experiment=embedded/$name logger=csv trainer.enable_progress_bar=false output_dir="$out/$name"
done
lgc-report "$out" --out "$out/report"
