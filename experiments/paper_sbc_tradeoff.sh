#!/usr/bin/env bash
# The sweep in paper/sbc_tradeoff (its hydra.sweeper.params), then one table.
set -euo pipefail
data=${1:?usage: paper_sbc_tradeoff.sh CIFAR10_FOLDER}
lgc-train -m experiment=paper/sbc_tradeoff data.root="$data" hydra.sweep.dir=multirun/sbc_tradeoff
lgc-report multirun/sbc_tradeoff --out multirun/sbc_tradeoff/report
