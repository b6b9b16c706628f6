#!/usr/bin/env bash
# The sweep in paper/random_block_study (its hydra.sweeper.params), then one table.
set -euo pipefail
data=${1:?usage: paper_random_block.sh CIFAR10_FOLDER}
lgc-train -m experiment=paper/random_block_study data.root="$data" hydra.sweep.dir=multirun/random_block_study
lgc-report multirun/random_block_study --out multirun/random_block_study/report
