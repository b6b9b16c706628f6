#!/usr/bin/env bash
# Every paper reproduction for a few steps on 2 CPU workers against real data folders.
set -euo pipefail
: "${CIFAR10_ROOT:?set CIFAR10_ROOT to a folder holding cifar-10-batches-py}"
: "${CAMVID_ROOT:?set CAMVID_ROOT to a CamVid folder (SegNet layout)}"
for config in "$(dirname "$0")"/configs/paper/*_smoke.yaml; do
  name=paper/$(basename "$config" .yaml)
  case $name in *camvid*) root=$CAMVID_ROOT ;; *) root=$CIFAR10_ROOT ;; esac
  lgc-train experiment=$name data.root="$root" logger=csv output_dir="outputs/smoke/$name"
done
