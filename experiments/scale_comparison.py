"""The comparison at scale, run exactly as ``scale_protocol.yaml`` fixes it.

    python experiments/scale_comparison.py [--out OUT] [--results RESULTS] [--cells C ...] [--methods M ...]
        [--extra OVERRIDE ...] [--dry-run]

Every cell x method x seed of the protocol, in its order, one ``lgc-train`` run at a time (each
run's 4 workers share the machine's cores). Runs write to ``OUT/CELL/METHOD/seedN`` (checkpoints
every 50 steps, the log beside it as ``seedN.log``); each finished run's ``summary.json`` is copied
to ``RESULTS/CELL/METHOD/seedN/`` (commit them as they arrive). Resumable: a run whose summary is in
RESULTS or OUT is skipped, and a stopped run resumes from its last checkpoint (``ckpt_path``).
``--cells`` / ``--methods`` pick a subset of the protocol's (never other seeds: the protocol fixes
them); ``--extra`` adds overrides to every run, replacing the protocol's for the same key
(``trainer=gpu model=pspnet``), whose records a different RESULTS folder should then hold. A failed
run is listed at the end and the others go on. Before the first run every cell x method is checked
as ``lgc-train`` checks a run before its workers start, and a refused one stops the sweep there,
named (``--no-check`` skips this). A summary in RESULTS or OUT that was run with other overrides than
the protocol's now (an earlier protocol, another ``--extra``) is reported and never counted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent
PROTOCOL = HERE / "scale_protocol.yaml"


def load_protocol(path: Path = PROTOCOL) -> dict[str, Any]:
    """The protocol, checked: every ordered cell and method defined, seeds distinct.

    A study protocol names the protocol it ``extends`` (a file beside it): it takes that protocol's
    seeds, margin, reference, common overrides, cells and methods, adds its own methods (and
    cells), and has its own order, changes and tables (``tables``: the files ``scale_tables.py``
    writes); the other protocol's default rule is not a study's.
    """
    protocol = yaml.safe_load(path.read_text())
    if "extends" in protocol:
        base = yaml.safe_load((path.parent / protocol.pop("extends")).read_text())
        base.pop("default_rule", None)
        protocol = {
            **base,
            **protocol,
            "cells": {**base["cells"], **protocol.get("cells", {})},
            "methods": {**base["methods"], **protocol.get("methods", {})},
            "changes": protocol.get("changes", []),
        }
    for kind in ("cells", "methods"):
        missing = [name for name in protocol["order"][kind] if name not in protocol[kind]]
        if missing:
            raise ValueError(f"{path}: order.{kind} names {missing}, which {kind} does not define")
    if len(set(protocol["seeds"])) != len(protocol["seeds"]):
        raise ValueError(f"{path}: seeds {protocol['seeds']} repeat a seed")
    if protocol["confidence"] != 0.95:
        raise ValueError(f"{path}: confidence {protocol['confidence']}: lgc's intervals are at 0.95")
    if protocol["reference"] not in protocol["methods"]:
        raise ValueError(f"{path}: the reference {protocol['reference']!r} is not among the methods")
    return protocol


def run_overrides(protocol: dict[str, Any], cell: str, method: str, seed: int) -> list[str]:
    """The ``lgc-train`` overrides of one run (output folder and resumption left out)."""
    spec, how = protocol["cells"][cell], protocol["methods"][method]
    steps = int(spec["steps"])
    values = {"seed": seed, "steps": steps, "dgc_epoch": max(1, steps // 160)}
    per_step = [] if how.get("local_steps") else list(spec.get("per_step", []))
    overrides = [*protocol["common"], *spec["overrides"], *how["overrides"], *per_step]
    if "codec_at" in how:  # the codec the protocol's rule picks at this density (lgc_codec_rule.py)
        from lgc_codec_rule import codec_choice

        overrides += codec_choice(protocol["codec_rule"], float(how["codec_at"]))[1]
    return [override.format(**values) for override in overrides]


def with_extra(overrides: list[str], extra: list[str]) -> list[str]:
    """``overrides`` with ``extra`` appended, each extra replacing an earlier override of the same key
    (``model=pspnet`` replaces a cell's ``model=pspnet_small``: Hydra refuses two values for one key)."""
    keys = {override.split("=", 1)[0] for override in extra}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + list(extra)


def recorded_overrides(summary: Path) -> list[str] | None:
    """The overrides a finished run was given (``summary.json``'s ``hydra``), its folders left out."""
    record = json.loads(summary.read_text()).get("hydra")
    if record is None:
        return None
    return [o for o in record["overrides"] if not o.startswith(("output_dir=", "ckpt_path="))]


def _checkpoint_step(path: Path) -> int:
    """The optimizer step a Lightning checkpoint was saved at."""
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False, mmap=True)["global_step"])


def planned_runs(
    protocol: dict[str, Any], cells: list[str] | None = None, methods: list[str] | None = None
) -> list[tuple[str, str, int]]:
    """``(cell, method, seed)`` of every run, in the protocol's order (restricted to ``cells`` / ``methods``)."""
    for kind, chosen in (("cells", cells), ("methods", methods)):
        unknown = sorted(set(chosen or ()) - set(protocol[kind]))
        if unknown:
            raise SystemExit(f"unknown {kind} {unknown}: the protocol has {sorted(protocol[kind])}")
    return [
        (cell, method, seed)
        for cell in protocol["order"]["cells"]
        if cells is None or cell in cells
        for method in protocol["order"]["methods"]
        if methods is None or method in methods
        for seed in protocol["seeds"]
    ]


def check_runs(protocol: dict[str, Any], runs: list[tuple[str, str, int]], extra: list[str]) -> list[str]:
    """Every distinct cell x method of ``runs`` composed and checked as ``lgc-train`` checks a run before
    its workers start (data, model, method, stages against the run's length); the refusals, named."""
    from hydra import compose, initialize_config_module

    from lgc.train import _prepare

    refused = []
    with initialize_config_module("lgc.conf", version_base="1.3"):
        for cell, method in dict.fromkeys((cell, method) for cell, method, _ in runs):
            overrides = with_extra(run_overrides(protocol, cell, method, protocol["seeds"][0]), extra)
            try:
                _prepare(compose("train", overrides=[*overrides, "output_dir=outputs/scale_comparison/check"]))
            except Exception as error:  # noqa: BLE001 (every refusal is reported, none stops the others)
                refused.append(f"{cell}/{method}: {type(error).__name__}: {error}")
    return refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/scale_comparison"))
    parser.add_argument("--results", type=Path, default=HERE / "results" / "scale")
    parser.add_argument("--protocol", type=Path, default=PROTOCOL)
    parser.add_argument("--cells", nargs="+")
    parser.add_argument("--methods", nargs="+")
    parser.add_argument("--extra", nargs="+", default=[], help="overrides added to every run")
    parser.add_argument("--dry-run", action="store_true", help="print the commands of the runs still to do")
    parser.add_argument("--no-check", action="store_true", help="skip checking every run's config first")
    args = parser.parse_args(argv)
    protocol = load_protocol(args.protocol)
    runs = planned_runs(protocol, args.cells, args.methods)
    if not args.no_check and not args.dry_run:
        refused = check_runs(protocol, runs, args.extra)
        if refused:
            print("refused before any run started:\n" + "\n".join(refused), file=sys.stderr)
            return 2
    failed = []
    for cell, method, seed in runs:
        run_dir = args.out / cell / method / f"seed{seed}"
        kept = args.results / cell / method / f"seed{seed}"
        # lgc-train's own code (python -m lgc.train runs it without the console script's import check)
        try:
            overrides = with_extra(run_overrides(protocol, cell, method, seed), args.extra)
        except ValueError as error:  # a study's codec rule not decided yet (checked runs never get here)
            print(f"{cell}/{method}/seed{seed}: undecided: {error}", flush=True)
            continue
        command = [sys.executable, "-m", "lgc.train", *overrides, f"output_dir={run_dir}"]
        stale = [f for f in (kept / "summary.json", run_dir / "summary.json") if f.is_file()
                 and recorded_overrides(f) != overrides]  # fmt: skip
        if stale:
            # Made under other settings (an earlier protocol, other --extra): never counted as this run.
            failed.append(f"{cell}/{method}/seed{seed} (stale {stale[0]})")
            print(f"{cell}/{method}/seed{seed}: {stale[0]} was run with other overrides; move it away", flush=True)
            continue
        if (run_dir / "summary.json").is_file() and not (kept / "summary.json").is_file():
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copy(run_dir / "summary.json", kept / "summary.json")
        if (kept / "summary.json").is_file():
            continue  # done already
        checkpoint = run_dir / "checkpoints" / "last.ckpt"
        if checkpoint.is_file() and _checkpoint_step(checkpoint) < int(protocol["cells"][cell]["steps"]):
            command.append(f"ckpt_path={run_dir}")  # stopped mid-run: go on from there
        elif checkpoint.is_file() and not args.dry_run:
            # Saved at the last step, stopped before its validation and summary: a resumed run would
            # have nothing left to train. Run it again from the start.
            checkpoint.rename(checkpoint.with_name("finished-unscored.ckpt"))
        if args.dry_run:
            print(" ".join(command))
            continue
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        start = time.time()
        done = _run_logged(command, run_dir.parent / f"seed{seed}.log")
        minutes = (time.time() - start) / 60
        if done.returncode == 0 and (run_dir / "summary.json").is_file():
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copy(run_dir / "summary.json", kept / "summary.json")
            print(f"{cell}/{method}/seed{seed}: done in {minutes:.1f} min", flush=True)
        else:
            failed.append(f"{cell}/{method}/seed{seed}")
            print(f"{cell}/{method}/seed{seed}: FAILED (rc {done.returncode}) after {minutes:.1f} min", flush=True)
    if failed:
        print("unfinished: " + " ".join(failed), file=sys.stderr)
        return 1
    return 0


#: Attempts of a run whose workers could not bind the rendezvous port: the port Lightning found free
#: was taken before its store listened (other jobs on the machine), which says nothing about the run.
PORT_ATTEMPTS = 3


def _run_logged(command: list[str], log_path: Path) -> subprocess.CompletedProcess:
    """Run ``command`` appending to ``log_path``; again (up to :data:`PORT_ATTEMPTS`) if only the port was taken."""
    for _ in range(PORT_ATTEMPTS):
        with open(log_path, "a") as log:
            offset = log.tell()
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
        with open(log_path, errors="replace") as log:
            log.seek(offset)
            port_taken = "EADDRINUSE" in log.read()
        if done.returncode == 0 or not port_taken:
            return done
    return done


if __name__ == "__main__":
    sys.exit(main())
