#!/usr/bin/env bash
# The package's encode + decode speed before and after a change, side by side on this machine:
# `lgc-bench compressors` (ResNet-50's shapes, density 0.1 %, one thread) of the tree at BEFORE (a
# git commit, checked out into a temporary worktree) and of this tree, alternately ROUNDS times
# (before, after, before, after, ...), so load changes hit both alike; then a table of each row's
# median "x fp16" (its time over the per-layer fp16 round trip of the same run) before and after,
# with the load average of every run. Needs a quiet machine (timings).
#   experiments/speed_before_after.sh BEFORE [OUT]      (OUT default: experiments/results/speed_before_after)
#   ROUNDS=3 DENSITY=0.01 experiments/speed_before_after.sh bcf3643
#   ONLY="demo dgc" experiments/speed_before_after.sh be9641c OUT   (those compressors' rows and the references)
set -euo pipefail
before=${1:?usage: experiments/speed_before_after.sh BEFORE_COMMIT [OUT]}
out=$(realpath -m "${2:-experiments/results/speed_before_after}")
rounds=${ROUNDS:-2}
density=${DENSITY:-0.001}
repeats=${REPEATS:-5}
only=${ONLY:+--only $ONLY}
root=$(git rev-parse --show-toplevel)
tree=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$tree" > /dev/null 2>&1 || rm -rf "$tree"' EXIT
git -C "$root" worktree add --detach --force "$tree" "$before" > /dev/null
mkdir -p "$out"
export OMP_NUM_THREADS=1
for round in $(seq 1 "$rounds"); do
  (cd "$tree" && PYTHONPATH="$tree" python -m lgc.bench.cli compressors --density "$density" --repeats "$repeats" $only \
    --json "$out/before_$round.json" > "$out/before_$round.md" 2>&1)
  (cd "$root" && PYTHONPATH="$root" python -m lgc.bench.cli compressors --density "$density" --repeats "$repeats" $only \
    --json "$out/after_$round.json" > "$out/after_$round.md" 2>&1)
done
python - "$out" "$before" "$(git -C "$root" rev-parse --short HEAD)" "$rounds" <<'PY' | tee "$out/README.md"
import json, statistics, sys
from pathlib import Path

out, before, after, rounds = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
runs = {side: [json.loads((out / f"{side}_{r}.json").read_text()) for r in range(1, rounds + 1)] for side in ("before", "after")}


def ratios(side: str) -> dict[str, list[float]]:
    table: dict[str, list[float]] = {}
    for run in runs[side]:
        for row in run["references"] + run["rows"]:
            if row.get("x_fp16_wall") is not None:
                table.setdefault(row["name"], []).append(row["x_fp16_wall"])
    return table


old, new = ratios("before"), ratios("after")
first = runs["after"][0]
print(f"# Encode + decode before ({before}) and after ({after}), side by side\n")
print(f"`lgc-bench compressors --density {first['density']}`: {first['numel']:,} elements in {first['tensors']} tensors "
      f"(ResNet-50's shapes), {first['device']}, {first['threads']} thread(s), {rounds} alternating runs of each tree "
      f"(before, after, ...), {first['repeats']} interleaved rounds per run. x fp16: a row's median wall time over "
      "the per-layer fp16 round trip into reused buffers of the same run; the median over the runs is shown.\n")
print("| row | before x fp16 | after x fp16 | after / before |")
print("|---|---|---|---|")
for name in sorted(set(old) | set(new)):
    a = statistics.median(old[name]) if name in old else None
    b = statistics.median(new[name]) if name in new else None
    change = f"{b / a:.2f}" if a and b else "-"
    print(f"| {name} | {'-' if a is None else f'{a:.2f}'} | {'-' if b is None else f'{b:.2f}'} | {change} |")
print("\nLoad average (1 / 5 / 15 min) at the start of each run:\n")
for side in ("before", "after"):
    for r, run in enumerate(runs[side], 1):
        print(f"- {side} {r}: {' / '.join(f'{x:.2f}' for x in run['load_average_start'])}")
PY
