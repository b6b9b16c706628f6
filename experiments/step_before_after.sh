#!/usr/bin/env bash
# The DDP step's cost before and after a change, side by side on this machine: `lgc-bench step`
# (ResNet-50 shapes, 2 gloo workers, one thread each) of the tree at BEFORE (a git commit, checked
# out into a temporary worktree) and of this tree, alternately ROUNDS times per density (before,
# after, before, after, ...), so load changes hit both alike; then a table of each method's median
# CPU step over the no-communication step of the same run (`cpu_x`, which both trees report), before
# and after, with the load average of every run. The methods are the per-step ones both trees take
# (the older tree has no delay knobs); DDP's own step (`ddp`, no hook) is the goals' reference.
# Needs a quiet machine (timings), about 10 min per run with every method. Resumable: runs whose
# record is there are skipped.
#   experiments/step_before_after.sh BEFORE [OUT]      (OUT default: experiments/results/step_before_after)
#   ROUNDS=1 DENSITIES=0.01 experiments/step_before_after.sh bcf3643
set -euo pipefail
before=${1:?usage: experiments/step_before_after.sh BEFORE_COMMIT [OUT]}
out=$(realpath -m "${2:-experiments/results/step_before_after}")
rounds=${ROUNDS:-2}
densities=${DENSITIES:-0.001 0.01}
methods=${METHODS:-ddp,none,torch_fp16,powersgd,topk,dgc,sbc,redsync,random_block,qsgd,terngrad,signsgd,fp4,chunked_topk,shared_topk_int8,lgc_rar,demo}
root=$(git rev-parse --show-toplevel)
tree=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$tree" > /dev/null 2>&1 || rm -rf "$tree"' EXIT
git -C "$root" worktree add --detach --force "$tree" "$before" > /dev/null
mkdir -p "$out"
# The before run takes the methods its tree knows (an older tree may lack DDP's own row or a method).
before_methods=$(cd "$tree" && PYTHONPATH="$tree" python - "$methods" <<'PY'
import sys
from pathlib import Path

from lgc.api import METHODS

ddp = any('"ddp"' in p.read_text() for p in map(Path, ("lgc/bench/step.py", "lgc/bench/step_rows.py")) if p.exists())
names = [m for m in sys.argv[1].split(",") if m.split(":")[0] in METHODS or (m == "ddp" and ddp)]
print(",".join(names))
PY
)
for density in $densities; do
  for round in $(seq 1 "$rounds"); do
    # A run whose record exists is kept (a stopped comparison resumes where it was).
    [ -s "$out/before_${density}_$round.json" ] ||
      (cd "$tree" && PYTHONPATH="$tree" python -m lgc.bench.cli step --density "$density" --steps 10 --rounds 2 \
        --methods "$before_methods" --json "$out/before_${density}_$round.json" > "$out/before_${density}_$round.md" 2>&1)
    [ -s "$out/after_${density}_$round.json" ] ||
      (cd "$root" && PYTHONPATH="$root" python -m lgc.bench.cli step --density "$density" --steps 10 --rounds 2 \
        --methods "$methods" --json "$out/after_${density}_$round.json" > "$out/after_${density}_$round.md" 2>&1)
  done
done
python - "$out" "$before" "$(git -C "$root" rev-parse --short HEAD)" "$rounds" "$densities" <<'PY' | tee "$out/README.md"
import json, statistics, sys
from pathlib import Path

out, before, after, rounds, densities = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5].split()


def runs(side: str, density: str) -> list[dict]:
    return [json.loads((out / f"{side}_{density}_{r}.json").read_text()) for r in range(1, rounds + 1)]


print(f"# The DDP step before ({before}) and after ({after}), side by side\n")
first = runs("after", densities[0])[0]
print(f"`lgc-bench step --steps 10 --rounds 2`: {first['model']}, {first['workers']} gloo workers, one thread each, "
      f"{rounds} alternating runs of each tree per density (before, after, ...). x no-comm: a method's median CPU step "
      "(all workers) over the no-communication step (`no_sync`) of the same run; x ddp: the same over DDP's own "
      "fp32 allreduce step (`ddp`, no hook) of the same run; the median over the runs is shown.\n")
for density in densities:
    old, new = runs("before", density), runs("after", density)
    print(f"## density {density}\n")
    ddp = "ddp" in new[0]["rows"]
    print("| method | before x no-comm | after x no-comm | after / before |" + (" before x ddp | after x ddp |" if ddp else ""))
    print("|---|---|---|---|" + ("---|---|" if ddp else ""))
    names = [n for n in new[0]["rows"] if n != "no_sync"]
    for name in names:
        a = statistics.median(r["rows"][name]["cpu_x"] for r in old) if name in old[0]["rows"] else None
        b = statistics.median(r["rows"][name]["cpu_x"] for r in new)
        change = f"{b / a:.2f}" if a else "-"
        row = f"| {name} | {'-' if a is None else f'{a:.2f}'} | {b:.2f} | {change} |"
        if ddp:
            def over_ddp(group: list[dict]) -> str:
                if name not in group[0]["rows"] or "ddp" not in group[0]["rows"]:
                    return "-"
                return f"{statistics.median(r['rows'][name]['cpu_x'] / r['rows']['ddp']['cpu_x'] for r in group):.2f}"
            row += f" {over_ddp(old)} | {over_ddp(new)} |"
        print(row)
    print("\nLoad average (1 / 5 / 15 min) at the start of each run:\n")
    for side, group in (("before", old), ("after", new)):
        for r, run in enumerate(group, 1):
            print(f"- {side} {r}: {' / '.join(f'{x:.2f}' for x in run['load_average'][0])}")
    print()
PY
