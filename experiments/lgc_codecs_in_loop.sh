#!/usr/bin/env bash
# LGC-RAR's codec family in the training loop, on the lean footing (experiment=embedded/lgc_rar_lean:
# 1 dense warm-up step, 20 codec-training steps, int8 latents, Golomb positions in position order,
# rotating leader): Fashion-MNIST, ResNet-8, 4 workers x 32 images, 150 steps, seeds 0-2, each run
# measuring the relative error of the delivered sum against the exact one at the leader's positions
# (compressor.measure_error=true; lgc_true_error in summary.json, "error at leader positions" in
# lgc-report's runs table). Variants: the linear codec (PCA) with the paper's stage-2 samples (own
# top-k) and with training.samples=leader; the PCA-initialised autoencoder; the paper's autoencoder at
# the reference widths and at a quarter of them. Each finished run's summary.json goes to
# RESULTS/VARIANT/seedN (resumable: runs that have one are skipped); then lgc-report RESULTS.
#   experiments/lgc_codecs_in_loop.sh [OUT]
#   SEEDS="0" VARIANTS="linear ae" experiments/lgc_codecs_in_loop.sh
# Needs the dataset: apt-get install dataset-fashion-mnist (or FASHION_MNIST_ROOT).
set -euo pipefail
out=${1:-outputs/lgc_codecs_in_loop}
results=${RESULTS:-experiments/results/lgc_codecs_in_loop}
declare -A variant=(
  [linear]=""
  [linear_leader]="compressor.training.samples=leader"
  [pcaae]="compressor.training.codec=pca_autoencoder compressor.training.pca_hidden=64 compressor.training.loss_weights.similarity=0"
  [ae]="compressor.training.codec=autoencoder"
  [ae_w025]="compressor.training.codec=autoencoder compressor.training.autoencoder.width=0.25"
)
for seed in ${SEEDS:-0 1 2}; do
  for name in ${VARIANTS:-linear linear_leader pcaae ae ae_w025}; do
    [[ -v "variant[$name]" ]] || { echo "unknown variant $name (${!variant[*]})" >&2; exit 2; }
    kept="$results/$name/seed$seed"
    [ -f "$kept/summary.json" ] && continue
    dir="$out/$name/seed$seed"
    # shellcheck disable=SC2086  # the settings are a word list
    lgc-train data=fashion_mnist data.batch_size=32 trainer.devices=4 ddp.oversubscribe=true \
      trainer.max_steps=150 trainer.max_epochs=1 seed="$seed" logger=csv trainer.enable_progress_bar=false \
      experiment=embedded/lgc_rar_lean compressor.measure_error=true ${variant[$name]} output_dir="$dir"
    mkdir -p "$kept" && cp "$dir/summary.json" "$kept/"
  done
done
lgc-report "$results" --label folder --out "$results/report" --json "$results/report/rows.json"
