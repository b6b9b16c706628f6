#!/usr/bin/env bash
# The sweep in paper/redsync_selection (its hydra.sweeper.params), then one table.
set -euo pipefail
data=${1:?usage: paper_redsync.sh CIFAR10_FOLDER}
lgc-train -m experiment=paper/redsync_selection data.root="$data" hydra.sweep.dir=multirun/redsync_selection
lgc-report multirun/redsync_selection --out multirun/redsync_selection/report
