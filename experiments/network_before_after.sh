#!/usr/bin/env bash
# The step over a shaped network before and after a change, side by side on this machine:
# `lgc-bench network` (4 workers, each in its own network namespace behind a link shaped by tc to
# BANDWIDTH) of the tree at BEFORE (a git commit, checked out into a temporary worktree) and of this
# tree, alternately ROUNDS times (before, after, ...), so load changes hit both alike; then each
# method's median step (ms) and its multiple of dense's step in the same run, before and after,
# with the load average. The task is the one both trees have, scikit-learn's digits with ResNet-8:
# the gradients have the Fashion-MNIST task's shapes (the same ResNet-8 on 1-channel images, 10
# classes), so the wire and the hook's work are the same and only the compute per step is smaller.
# A change that keeps the payloads bit-identical keeps the accuracy step by step, so time to
# accuracy scales with the step. Needs root, iproute2 and a quiet machine (timings), about 15 min.
#   sudo experiments/network_before_after.sh BEFORE [OUT]   (OUT default: experiments/results/network_before_after)
#   BANDWIDTH=1gbit ROUNDS=1 sudo experiments/network_before_after.sh bcf3643
set -euo pipefail
before=${1:?usage: experiments/network_before_after.sh BEFORE_COMMIT [OUT]}
out=$(realpath -m "${2:-experiments/results/network_before_after}")
rounds=${ROUNDS:-2}
bandwidth=${BANDWIDTH:-100mbit}
steps=${STEPS:-150}
methods=${METHODS:-none,torch_fp16,topk,dgc,shared_topk_int8,sbc:delay=4;min_numel=0,sparseloco:delay=10}
root=$(git rev-parse --show-toplevel)
tree=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$tree" > /dev/null 2>&1 || rm -rf "$tree"' EXIT
git -C "$root" worktree add --detach --force "$tree" "$before" > /dev/null
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    dir=$([ "$side" = before ] && echo "$tree" || echo "$root")
    rm -rf "$out/${side}_$round"
    cat /proc/loadavg > "$out/${side}_$round.load"
    (cd "$dir" && PYTHONPATH="$dir" python -m lgc.bench.cli network --task digits --workers 4 --bandwidth "$bandwidth" \
      --steps "$steps" --methods "$methods" --out "$out/${side}_$round" > "$out/${side}_$round.log" 2>&1)
    rm -f "$out/${side}_$round"/network.json "$out/${side}_$round"/network.json.gz "$out/${side}_$round"/*.png \
      "$out/${side}_$round.log"  # its stdout names the temporary worktree; network.md holds the tables
  done
done
python - "$out" "$before" "$(git -C "$root" rev-parse --short HEAD)" "$rounds" "$bandwidth" <<'PY' | tee "$out/README.md"
import statistics, sys
from pathlib import Path

out, before, after, rounds, bandwidth = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]


def steps(side: str, r: int) -> dict[str, float]:
    """method -> median step (ms), from the first table of the run's network.md."""
    rows, seen = {}, False
    for line in (out / f"{side}_{r}" / "network.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| method | step (ms)"):
            if seen:
                break
            seen = True
        elif seen and line.startswith("|") and not line.startswith("|---"):
            rows[cells[0]] = float(cells[1])
        elif seen and rows and not line.startswith("|"):
            break
    return rows


runs = {side: [steps(side, r) for r in range(1, rounds + 1)] for side in ("before", "after")}
print(f"# The step over {bandwidth} links before ({before}) and after ({after}), side by side\n")
print(f"`lgc-bench network --task digits --workers 4 --bandwidth {bandwidth}`: ResNet-8 (the Fashion-MNIST task's "
      f"gradient shapes), {rounds} alternating runs of each tree (before, after, ...). Step: the run's median step "
      "(ms); x dense: over dense's (`none`) step in the same run; the median over the runs is shown.\n")
print("| method | before step (ms) | after step (ms) | after / before | before x dense | after x dense |")
print("|---|---|---|---|---|---|")
for name in runs["after"][0]:
    a = [run[name] for run in runs["before"] if name in run]
    b = [run[name] for run in runs["after"]]
    ax = [run[name] / run["none"] for run in runs["before"] if name in run]
    bx = [run[name] / run["none"] for run in runs["after"]]
    if a:
        print(f"| {name} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | "
              f"{statistics.median(b) / statistics.median(a):.2f} | {statistics.median(ax):.2f} | {statistics.median(bx):.2f} |")
    else:
        print(f"| {name} | - | {statistics.median(b):.1f} | - | - | {statistics.median(bx):.2f} |")
print("\nLoad average (1 / 5 / 15 min) at the start of each run:\n")
for side in ("before", "after"):
    for r in range(1, rounds + 1):
        load = (out / f"{side}_{r}.load").read_text().split()[:3]
        print(f"- {side} {r}: {' / '.join(load)}")
PY
