#!/usr/bin/env bash
# LGC's tables: CIFAR-10 ResNet-50 and ResNet-101 (8 GPUs) and CamVid PSPNet (4 GPUs), each with
# LGC-RAR, LGC-PS, DGC (all at top-k density 0.1 %) and the dense baseline.
set -euo pipefail
cifar=${1:?usage: paper_lgc.sh CIFAR10_FOLDER CAMVID_FOLDER}
camvid=${2:?usage: paper_lgc.sh CIFAR10_FOLDER CAMVID_FOLDER}
for experiment in lgc_cifar10_resnet50 lgc_cifar10_resnet101 lgc_camvid_pspnet; do
  case $experiment in *camvid*) root=$camvid ;; *) root=$cifar ;; esac
  lgc-train -m experiment=paper/$experiment data.root="$root" 'compressor=lgc_rar_paper,lgc_ps_paper,dgc,none' \
    hydra.sweep.dir=multirun/$experiment
  lgc-report multirun/$experiment --out multirun/$experiment/report
done
