"""Time the steps the scale comparison's default rule reads (``scale_rule.py``), with repeats.

    python experiments/scale_step_cost.py [OUT] [--rounds 5] [--steps 4] [--densities 0.001 0.01]
    # default OUT: experiments/results/step_cost_scale

``lgc-bench step`` (ResNet-50 shapes, 2 gloo workers, one thread each) times every method of
``scale_rule.STEP_ROWS`` beside DDP's own step, in interleaved rounds, at each density of the rule;
``cpu_vs_ddp`` (the mean over the rounds of the CPU step over DDP's in the same round, with its 95 %
interval) is what the rule bounds. Every worker keeps a ResNet-50 and its state per method, so the
methods are timed in groups (all at once exceeds 24 GB at 1 %), each group with DDP's row again;
each table is written as ``OUT/step_DENSITY[_GROUP].{md,json}`` (the first group without a suffix).
The timed steps per method (rounds x steps) are a multiple of every delay in the rows (4 and 10),
so a method with local steps is read by its mean. Needs a quiet machine: stop every other job first.
A table already written is not timed again (delete it to repeat it).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

from scale_comparison import HERE, load_protocol
from scale_rule import STEP_ROWS

#: Methods per ``lgc-bench step`` run (each worker holds one ResNet-50 and its state per method).
GROUP_SIZE = 5
#: Local-step delays among the rows: the timed steps must be a multiple of each.
DELAYS = (4, 10)


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
    timed = args.rounds * args.steps
    if args.rounds < 2 or timed % math.lcm(*DELAYS):
        multiple = math.lcm(*DELAYS)
        parser.error(f"--rounds >= 2 and rounds x steps a multiple of {multiple}, got {args.rounds} x {args.steps}")
    densities = args.densities or load_protocol()["default_rule"]["densities"]
    args.out.mkdir(parents=True, exist_ok=True)
    for density in densities:
        for index, methods in enumerate(groups()):
            stem = args.out / (f"step_{density}" + (f"_{index}" if index else ""))  # (no suffix: "0.001" has a dot)
            if Path(f"{stem}.json").is_file():
                print(f"{stem}.json: timed before")
                continue
            settings = ["--density", str(density), "--rounds", str(args.rounds), "--steps", str(args.steps)]
            command = ["lgc-bench", "step", *settings, "--methods", ",".join(methods), "--json", f"{stem}.json"]
            print(" ".join(command), flush=True)
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode:
                print(result.stdout + result.stderr, file=sys.stderr)
                return result.returncode
            Path(f"{stem}.md").write_text(f"{' '.join(command)}\n\n{result.stdout}")
            print(result.stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
