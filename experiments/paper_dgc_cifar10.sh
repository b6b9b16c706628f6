#!/usr/bin/env bash
# DGC's CIFAR-10 ResNet-110 table on 4 GPUs: DGC at 0.1 % against the dense baseline (compressor=none
# brings the optimizer's momentum back: the dgc config is what turns it off).
set -euo pipefail
data=${1:?usage: paper_dgc_cifar10.sh CIFAR10_FOLDER}
out=multirun/dgc_cifar10_resnet110
lgc-train experiment=paper/dgc_cifar10_resnet110 data.root="$data" output_dir=$out/dgc
lgc-train experiment=paper/dgc_cifar10_resnet110 data.root="$data" compressor=none output_dir=$out/dense
lgc-report $out --out $out/report
