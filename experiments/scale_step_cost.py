"""Time the steps the scale comparison's default rule reads (``scale_rule.py``), with repeats.

    python experiments/scale_step_cost.py [OUT] [--rounds 5] [--steps 4] [--densities 0.001 0.01]
    # default OUT: experiments/results/step_cost_scale

``lgc-bench step`` (ResNet-50 shapes, 2 gloo workers, one thread each) times every method of
``scale_rule.STEP_ROWS`` beside DDP's own step, in interleaved rounds, at each density of the rule;
``cpu_vs_ddp`` (the mean over the rounds of the CPU step over DDP's in the same round, with its 95 %
interval) is what the rule bounds. Every worker keeps a ResNet-50 and its state per method, so the
methods are timed in groups (all at once exceeds 24 GB at 1 %), each group with DDP's row again;
each table is written as ``OUT/step_DENSITY[_GROUP].{md,json}`` (the first group without a suffix).
Each group's round is ``--steps`` steps, or the least multiple of every delay in the group above it
(the group with SBC's delay of 4: 4; DiLoCo's and SparseLoCo's 10: 10): a method with local steps
is read by its mean, and a round of whole delays is what makes its rounds' ratios draws of one
quantity, so that their interval measures noise, not where the exchanges fell. Needs a quiet machine:
stop every other job first. A table already written is not timed again (delete it to repeat it).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

from scale_comparison import HERE, load_protocol
from scale_rule import STEP_ROWS

from lgc.bench.methods import parse_methods
from lgc.bench.step_rows import PLAIN_DDP

#: Methods per ``lgc-bench step`` run (each worker holds one ResNet-50 and its state per method).
GROUP_SIZE = 5


def delay(row: str) -> int:
    """Steps between a row's exchanges (``lgc-bench step``'s ``delay`` knob; 1: every step)."""
    (spec,) = parse_methods(row, plain=(PLAIN_DDP,))
    return spec.delay


def round_steps(methods: list[str], steps: int) -> int:
    """Steps per round for a group: the least multiple of every delay in it that is at least ``steps``."""
    period = math.lcm(*(delay(row) for row in methods))
    return period * math.ceil(steps / period)


def _from_repository(path: Path) -> str:
    """``path`` as a committed table names it: from the repository's root (its name alone outside it),
    never an absolute path of this machine."""
    try:
        return path.resolve().relative_to(HERE.parent.resolve()).as_posix()
    except ValueError:
        return path.name


def groups() -> list[list[str]]:
    """The rows to time, in groups of at most ``GROUP_SIZE``, each led by DDP's own step."""
    rows = list(dict.fromkeys(STEP_ROWS.values()))
    return [["ddp", *rows[i : i + GROUP_SIZE]] for i in range(0, len(rows), GROUP_SIZE)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, default=HERE / "results" / "step_cost_scale")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--densities", nargs="+", type=float)
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 1:
        parser.error(f"--rounds >= 2 (an interval over the rounds) and --steps >= 1, got {args.rounds}, {args.steps}")
    densities = args.densities or load_protocol()["default_rule"]["densities"]
    args.out.mkdir(parents=True, exist_ok=True)
    for density in densities:
        for index, methods in enumerate(groups()):
            stem = args.out / (f"step_{density}" + (f"_{index}" if index else ""))  # (no suffix: "0.001" has a dot)
            if Path(f"{stem}.json").is_file():
                print(f"{stem}.json: timed before")
                continue
            steps = round_steps(methods, args.steps)
            settings = ["--density", str(density), "--rounds", str(args.rounds), "--steps", str(steps)]
            command = ["lgc-bench", "step", *settings, "--methods", ",".join(methods), "--json", f"{stem}.json"]
            print(" ".join(command), flush=True)
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode:
                print(result.stdout + result.stderr, file=sys.stderr)
                return result.returncode
            shown = [*command[:-1], _from_repository(Path(f"{stem}.json"))]
            Path(f"{stem}.md").write_text(f"{' '.join(shown)}\n\n{result.stdout}")
            print(result.stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
