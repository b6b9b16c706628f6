#!/usr/bin/env bash
# LGC-RAR's compressed-stage step against DDP's own allreduce step at ResNet-50's training shape:
# lgc-bench step (2 gloo workers on this machine, one thread each, interleaved rounds) with 32 images of
# 224x224 per worker (ImageNet's usual per-GPU batch), at densities 0.1 % and 1 %: the reference
# autoencoder (lgc_rar's default) and the linear codec, beside DDP. Each table also counts every
# method's arithmetic (GFLOP per worker): the codec's work grows with the density, the model's with
# the batch, so the same codec costs a multiple of the step at lgc-bench step's default batch (8 images
# of 64x64; experiments/step_cost.sh) and a few percent of it here. Needs a quiet machine (timings)
# and about 15 min per density; a density whose table exists is skipped.
# Writes OUT/step_224_DENSITY.{md,json}.
#   [DENSITIES="0.01 0.001"] experiments/lgc_step_shapes.sh [OUT]
set -euo pipefail
out=${1:-experiments/results/lgc_cost}
mkdir -p "$out"
for density in ${DENSITIES:-0.01 0.001}; do
  table="$out/step_224_${density}"
  [[ -s "$table.json" ]] && { echo "$table.json exists: skipped"; continue; }
  lgc-bench step --density "$density" --batch-size 32 --image-size 224 --steps 1 --rounds 3 \
    --methods "ddp,lgc_rar,lgc_rar:training.codec=linear" --json "$table.json.part" | tee "$table.md"
  mv "$table.json.part" "$table.json"
done
