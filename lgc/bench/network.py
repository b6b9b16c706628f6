"""``lgc-bench network``: methods side by side over a real shaped network, per step and to a target accuracy.

Starts ``--workers`` processes (default 4), each in its own Linux network namespace, joined by
veth pairs to a bridge with every link shaped by ``tc`` (:class:`lgc.bench.netns.ShapedNetwork`:
``--bandwidth`` per link and direction, optional ``--delay`` per link), and gloo over TCP between
them. For every bandwidth and every method (methods in a rotated order on each ``--seeds``
round, so slow drifts hit all alike) the workers train ``--steps`` steps of ``--task``
(:mod:`lgc.bench.network_worker`) and the benchmark reports, per method:

* per step (median over the steady steps: past the first ``--skip`` and past the method's own
  stages, LGC's warm-up and autoencoder training, PowerSGD's dense steps, DGC's density warm-up;
  the first steady step is in the JSON as ``steady_from``): wall time, compute (forward,
  backward without communication), encode and decode (lgc's compressors; ``-`` where
  the coding is interleaved with the collectives: LGC, PyTorch's hooks), communication (the rest:
  wall - compute - encode - decode), CPU time, and the wire bytes a worker sends
  (:mod:`lgc.ddp.wire`); "own work alone" is the method's whole overhead (encoding, decoding, the
  hook's bookkeeping) measured with every worker running it alone in a group of its own before
  training, the one figure that covers LGC and PyTorch's hooks too;
* step time as a multiple of dense fp32's (``none``) and of PyTorch's fp16 hook (``torch_fp16``),
  measured in the same run;
* training seconds until the validation accuracy first reaches ``--target`` (evaluated every
  ``--eval-every`` steps on the synchronized model, for local-step methods too; evaluation is off
  the clock; the learning rate follows ``--schedule``, by default a cosine to 0 over ``--steps``,
  under which the curves rise steadily where a constant rate makes them swing by points between
  evaluations) and the final accuracy; over ``--seeds`` (each seed one round over all methods: its
  initialization and batches), their mean and 95 % interval, and each method's time to target as
  a multiple of the **no-communication bound**: dense's steps to the target on that seed times its
  compute-only step, the time any method would need if communication were free
  (:func:`lgc.bench.network_results.over_seeds`). ``--task fashion_mnist`` (ResNet-8, the
  10,000 test images) is the task that separates methods;
* the cross-check: bytes the workers' interfaces sent during the training loops
  (``/sys/class/net``'s counters read by each worker, headers and retransmissions included) over
  the wire bytes lgc counted, module buffers included (:mod:`lgc.ddp.buffers`). The rest is
  TCP/IP/Ethernet framing (66 bytes per frame of at most 1448 payload bytes: about 4.6 %), ACKs,
  gloo's own message headers, and the barriers around evaluations, which lgc does not count.
  Measured here (4 workers, 100 Mbit/s, 40 steps): 1.07 for dense; SparseLoCo with H = 10 sends
  so little that the same overhead, about 70 KB per worker and alike on every rank, makes 2.05
  (with DDP's own broadcast of rank 0's BatchNorm statistics before every forward, which no hook
  sees, it reads 3.44: rank 0, the root of the broadcast tree, sends 185 KB more than a leaf);
* the cost model's validation (:mod:`lgc.bench.cost_model`): before the methods, plain allreduces
  and allgathers of 256 B to 4 MB over the same network fit the link's latency and bandwidth;
  every worker measures each method alone in a group of its own before training; the model then
  predicts each method's steady step from those and the collectives of its last step, printed
  next to the measured step.

``--workers`` and ``--bandwidth`` take lists: every pair gets its own network and calibration.
A ``--methods`` entry may carry knobs, as in ``lgc-bench step``: ``none:delay=10;outer=sgd`` is
DiLoCo with H = 10, ``sparseloco:delay=10`` SparseLoCo, ``demo:lr=0.003`` DeMo with its sign-SGD
step size (``lr`` and ``momentum`` go to the worker's SGD, the rest to ``lgc.compress``). With
``delay`` most steps send nothing: the per-step medians are local steps, so compare the mean
step, the whole run's wire MB, the time to target and the accuracy at equal wire bytes (the
accuracy every method had reached when it had sent as many bytes as the thriftiest one sent in
its whole run), printed below each table.
``--from-json`` reports a saved ``network.json.gz`` (or a plain ``.json``) again without measuring.
A run with ``--out`` resumes: the (setting, method, seed) measurements already in
``OUT/network.json.gz`` are kept and skipped, with the setting's calibration, so a long comparison
can be stopped and started again; a record measured with other training settings is refused rather
than mixed in.

Output: a markdown table (stdout and ``--out``/``network.md``), ``network.json.gz`` (every step
of every rank, gzipped JSON with floats to 6 significant digits, rewritten whole after every
measurement; each measurement records the commit its workers imported, ``provenance``) and
``accuracy_vs_time.png`` (validation accuracy against training seconds, and below against the wire
bytes a worker sent; one line per method, a panel per setting). Needs root and iproute2; without
them it says what is missing and exits with status 2 before creating anything. Every namespace and
interface it creates is removed at the end, on Ctrl-C and when a worker crashes.

Why one module: the ``lgc-bench network`` command: its arguments, the calibration of the shaped
link, each measurement's run and its record (rewritten after each, so a stopped run resumes), and
the report of those records.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lgc.bench import netns
from lgc.bench.cost_model import MethodProfile, comm_seconds, fit_link, predict_step
from lgc.bench.methods import (
    DEFAULT_METHODS,
    OPTIMIZER_KNOBS,
    SHORT_RUN_KNOBS,
    parse_list,
    parse_methods,
)
from lgc.bench.netns import counter_delta, parse_delay, parse_rate
from lgc.bench.network_results import (
    combine_seeds,
    equal_bytes_table,
    eval_line,
    over_seeds,
    plot_results,
    seeds_table,
    step_table,
    summarize,
    validation_table,
)
from lgc.bench.network_worker import SCHEDULES, TASKS, WorkerSpec
from lgc.ddp.collectives import CollectiveCall
from lgc.methods import merge_knobs
from lgc.provenance import run_provenance

__all__ = ["RECORD", "add_arguments", "read_record", "run", "validate", "write_record"]

#: The file in ``--out`` that holds every measurement (:func:`write_record`).
RECORD = "network.json.gz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", default="4", help="comma-separated worker counts, one namespace per worker (default 4)"
    )
    parser.add_argument(
        "--bandwidth", default="100mbit,1gbit", help="comma-separated link rates in tc syntax (default 100mbit,1gbit)"
    )
    parser.add_argument("--delay", default=None, help="one-way delay per link, e.g. 1ms (default none)")
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated lgc.compress method names, each with optional knobs: name:key=value;... "
        "(lgc.compress's, e.g. none:delay=10;outer=sgd, or the optimizer's lr and momentum, e.g. demo:lr=0.003)",
    )
    parser.add_argument(
        "--task",
        default="digits",
        help="digits (ResNet-8 on 8x8 digits), fashion_mnist (ResNet-8 on Fashion-MNIST, validated on its 10,000 "
        "test images; the dataset from FASHION_MNIST_ROOT or the dataset-fashion-mnist package), or resnet18 or "
        "resnet50 on 8x8 digits",
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps per method (default 150)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=WorkerSpec.schedule,
        help="the learning rate over the run: cosine (to 0 at the last step, as lgc-train anneals, so the "
        "accuracy curves settle instead of swinging from one evaluation to the next) or constant (default cosine)",
    )
    parser.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps (default 10)")
    parser.add_argument("--target", type=float, default=0.9, help="target validation accuracy (default 0.9)")
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the per-step medians (default 5)")
    parser.add_argument(
        "--seeds",
        default="0",
        help="comma-separated seeds, one round over all methods each (model initialization and batches; "
        "default 0): time to target is reported as mean and 95 %% interval over them",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one measurement may take")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write network.md, network.json.gz and the plot here (a rerun skips what its network.json.gz holds)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="measure nothing: report a saved network.json.gz (or .json) again (--target, --skip and --out apply)",
    )


def _check_arguments(args: argparse.Namespace) -> tuple[list[int], list[Any], list[str], list[int]]:
    """Every bad value, before any namespace or process exists."""

    try:
        workers = [int(w) for w in parse_list(args.workers, "workers")]
    except ValueError as error:
        raise ValueError(f"--workers must be comma-separated integers, got {args.workers!r}") from error
    if min(workers) < 2:
        raise ValueError(f"--workers must be >= 2 (a network needs two ends), got {args.workers!r}")
    parse_list(args.methods, "methods")
    methods = parse_methods(args.methods)
    for spec in methods:
        for key in OPTIMIZER_KNOBS:
            value = spec.knobs.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{spec.label}: {key} must be a non-negative number, got {value!r}")
    bandwidths = parse_list(args.bandwidth, "bandwidth")
    for bandwidth in bandwidths:
        parse_rate(bandwidth)
    if args.delay is not None:
        parse_delay(args.delay)
    if args.task not in TASKS:
        raise ValueError(f"--task must be one of {TASKS}, got {args.task!r}")
    try:
        seeds = [int(seed) for seed in parse_list(args.seeds, "seeds")]
    except ValueError as error:
        raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from error
    if min(seeds) < 0 or len(set(seeds)) < len(seeds):
        raise ValueError(f"--seeds must be distinct non-negative integers, got {args.seeds!r}")
    for name in ("steps", "batch_size", "eval_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)!r}")
    if not 0 <= args.skip < args.steps:
        raise ValueError(f"--skip must be in [0, --steps={args.steps}), got {args.skip!r}")
    return workers, methods, bandwidths, seeds


def _data_root(task: str) -> str | None:
    """The Fashion-MNIST folder the workers read (checked, decompressed once here); None for the digits tasks."""
    if task != "fashion_mnist":
        return None
    from lgc.data.fashion_mnist import prepare_fashion_mnist

    return str(prepare_fashion_mnist(os.environ.get("FASHION_MNIST_ROOT") or None))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _measure(net: Any, spec: dict[str, Any], timeout: float, folder: Path) -> dict[str, Any]:
    """Run every worker of one method over ``net``; their records and the interfaces' byte counts."""

    port = _free_port()
    outputs = [folder / f"rank{rank}.json" for rank in range(net.workers)]
    logs = [folder / f"rank{rank}.log" for rank in range(net.workers)]
    before = net.counters()
    processes = []
    try:
        for rank in range(net.workers):
            env = {
                **os.environ,
                "MASTER_ADDR": net.address(0),
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(net.workers),
                "GLOO_SOCKET_IFNAME": net.interface(rank),
                "OMP_NUM_THREADS": "1",
            }
            argv = [sys.executable, "-m", "lgc.bench.network_worker", json.dumps(spec), str(outputs[rank])]
            with logs[rank].open("w") as log:
                processes.append(
                    subprocess.Popen(net.command(rank, argv), env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in processes]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                tail = logs[failed[0]].read_text()[-3000:]
                raise RuntimeError(f"{spec['method']}: worker rank {failed[0]} failed; its log ends:\n{tail}")
            if None not in codes:
                break
            if time.monotonic() > deadline:
                tail = logs[0].read_text()[-3000:]
                raise RuntimeError(
                    f"{spec['method']}: the workers took over {timeout:.0f} s; rank 0's log ends:\n{tail}"
                )
            time.sleep(0.2)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    interfaces = counter_delta(before, net.counters())
    return {"ranks": [json.loads(out.read_text()) for out in outputs], "interfaces": interfaces}


def _calibrate(net: Any, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Time allreduces and allgathers over ``net`` (the samples the cost model's link is fitted on)."""
    spec = {"method": "none", "mode": "collectives", "task": args.task}
    folder.mkdir()
    measurement = _measure(net, spec, args.timeout, folder)
    # Per repeat the slowest rank's clock (a collective ends when its last participant has its
    # result), then the mean over repeats: small messages here take either about 0.3 ms or a
    # scheduler tick (about 4 ms) on an oversubscribed machine, and a step pays the mean.
    samples = []
    for index, first in enumerate(measurement["ranks"][0]["collectives"]):
        repeats = zip(*(rank["collectives"][index]["times"] for rank in measurement["ranks"]), strict=True)
        slowest = [max(times) for times in repeats]
        samples.append({"kind": first["kind"], "nbytes": first["nbytes"], "seconds": statistics.fmean(slowest)})
    return {"samples": samples}


def validate(
    rows: list[dict[str, Any]], measurements: dict[str, list[dict[str, Any]]], link: Any, workers: int
) -> None:
    """Add the cost model's predicted step (``predicted_step_s``) to every row, from its workers' profiles.

    The prediction uses only what was measured without the network (each worker's profile in a
    group of its own: compute and the method's overhead), the collectives each worker issued in
    its last step, and the link fitted on plain collectives (:func:`_calibrate`).
    """

    for row in rows:
        runs = measurements[row["method"]]
        profiles = [MethodProfile.from_json(rank["profile"]) for run in runs for rank in run["ranks"]]
        slowest = max(profiles, key=lambda p: comm_seconds(p.trace, workers, link))
        typical = MethodProfile(
            method=row["method"],
            compute_s=statistics.median(p.compute_s for p in profiles),
            overhead_s=statistics.median(p.overhead_s for p in profiles),
            decode_per_peer_s=statistics.median(p.decode_per_peer_s for p in profiles),
            overlaps_backward=slowest.overlaps_backward,
            trace=slowest.trace,
            compute_samples_s=[t for p in profiles for t in p.compute_samples_s],
            trailing=slowest.trailing,
            period=slowest.period,
        )
        row["predicted_step_s"] = predict_step(typical, workers, link)
        row["predicted_comm_s"] = comm_seconds(typical.trace, workers, link) / typical.period
        row["profile_compute_s"] = typical.compute_s
        row["profile_overhead_s"] = typical.overhead_s


def run(args: argparse.Namespace) -> None:

    if args.from_json is not None:
        _from_json(args)
        return
    try:
        worker_counts, methods, bandwidths, seeds = _check_arguments(args)
        data_root = _data_root(args.task)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"lgc-bench network: {error}")
    try:
        netns.check_available(with_delay=args.delay is not None)
    except netns.NetworkUnavailable as error:
        print(f"lgc-bench network: cannot build the shaped network: {error}", file=sys.stderr)
        sys.exit(2)
    try:
        measurements, calibrations = _measured_before(args)
    except ValueError as error:
        sys.exit(f"lgc-bench network: {error}")
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="lgc-bench-network-") as scratch:
        for workers in worker_counts:
            for bandwidth in bandwidths:
                setting = f"{workers} workers, {bandwidth}"
                done = measurements.get(setting, {})
                if all(_has_seed(done.get(m.label, []), seed) for m in methods for seed in seeds):
                    print(f"{setting}: measured before, in {args.out / RECORD}", flush=True)
                    continue
                with netns.ShapedNetwork(workers, bandwidth, args.delay) as net:
                    if setting not in calibrations:
                        calibrations[setting] = _calibrate(net, args, Path(scratch) / f"{workers}-{bandwidth}-link")
                    fitted = _fitted_link(calibrations[setting], workers)
                    print(
                        f"{setting}: link fitted alpha {1e6 * fitted.latency_s:.0f} us, "
                        f"{8 * fitted.bytes_per_s / 1e6:.1f} Mbit/s (tc rate {parse_rate(bandwidth) / 1e6:g} Mbit/s)",
                        flush=True,
                    )
                    for repeat, seed in enumerate(seeds):
                        order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]
                        for index, method in enumerate(order):
                            if _has_seed(measurements.get(setting, {}).get(method.label, []), seed):
                                continue  # measured before this run (the record in --out)
                            knobs = merge_knobs(SHORT_RUN_KNOBS.get(method.name, {}), method.knobs)
                            optimizer = {key: knobs.pop(key) for key in OPTIMIZER_KNOBS if key in knobs}
                            spec = {
                                "method": method.name,
                                "label": method.label,
                                "task": args.task,
                                "steps": args.steps,
                                "batch_size": args.batch_size,
                                "lr": args.lr,
                                "schedule": args.schedule,
                                "eval_every": args.eval_every,
                                "seed": seed,
                                "data_root": data_root,
                                "knobs": knobs,
                                **optimizer,
                            }
                            folder = Path(scratch) / f"{workers}-{bandwidth}-{repeat}-{index}-{method.name}"
                            folder.mkdir()
                            started = time.perf_counter()
                            # The commit the workers import (they start now, from this checkout).
                            provenance = run_provenance()
                            measurement = {**_measure(net, spec, args.timeout, folder), "provenance": provenance}
                            measurements.setdefault(setting, {}).setdefault(method.label, []).append(measurement)
                            print(
                                f"{setting} {method.label} seed {seed}: {time.perf_counter() - started:.0f} s",
                                flush=True,
                            )
                            _keep(args, measurements, calibrations)
    try:
        _report(args, measurements, calibrations)
    except ValueError as error:
        kept = "" if args.out is None else f"; the measurements are kept in {args.out / RECORD}"
        sys.exit(f"lgc-bench network: {error}{kept}")


#: The arguments a measurement depends on: a resumed run must share them with the measurements it keeps.
_MEASURED_WITH = ("task", "steps", "batch_size", "lr", "schedule", "eval_every", "delay")


def _measured_before(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The measurements and calibrations of ``args.out``'s record (none without ``--out`` or the file).

    The record is :data:`RECORD`, or a plain ``network.json`` left by a run that wrote one.

    Raises:
        ValueError: the file was measured with other training settings (:data:`_MEASURED_WITH`).
    """
    if args.out is None:
        return {}, {}
    path = next((p for p in (args.out / RECORD, args.out / "network.json") if p.is_file()), None)
    if path is None:
        return {}, {}
    record = read_record(path)
    saved = record.get("arguments", {})
    differ = [
        f"--{name.replace('_', '-')} {saved.get(name)} there, {getattr(args, name)} here"
        for name in _MEASURED_WITH
        if saved.get(name) != str(getattr(args, name))
    ]
    if differ:
        raise ValueError(
            f"{path} holds measurements of other training settings ({'; '.join(differ)}): give another --out, "
            "or the same settings to resume it"
        )
    return record.get("raw", {}), record.get("calibrations", {})


def _has_seed(runs: list[dict[str, Any]], seed: int) -> bool:
    """Whether ``runs`` (one method's measurements in one setting) hold one of ``seed``."""
    return any(run["ranks"][0]["spec"].get("seed") == seed for run in runs)


def _keep(args: argparse.Namespace, measurements: dict[str, Any], calibrations: dict[str, Any], **report: Any) -> None:
    """With ``--out``: every measurement so far in :data:`RECORD` (read again with ``--from-json``),
    and the report's ``results`` and ``over_seeds`` once it is made.

    Written to a temporary file and renamed over the record, so a run stopped while writing leaves
    the previous record whole; a plain ``network.json`` it was resumed from is then removed.
    """
    if args.out is None:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    arguments = {k: str(v) for k, v in vars(args).items()}
    record = {"arguments": arguments, **report, "calibrations": calibrations, "raw": measurements}
    write_record(args.out / RECORD, record)
    (args.out / "network.json").unlink(missing_ok=True)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """``record`` as gzipped JSON at ``path``, floats to 6 significant digits, replacing the file atomically.

    Per-step timings and accuracies need no more digits; this keeps a 72-measurement comparison
    (1,000 steps of 4 ranks each) at a few MB. The gzip header carries neither a time stamp nor a
    file name, so the same record gives the same bytes.
    """
    scratch = path.with_name(path.name + ".tmp")
    with open(scratch, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as zipped:
        zipped.write(json.dumps(_compact(record)).encode())
    os.replace(scratch, path)


def read_record(path: Path) -> dict[str, Any]:
    """A record :func:`write_record` wrote (``.gz``), or a plain JSON one."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as text:
            return json.load(text)
    return json.loads(path.read_text())


def _compact(value: Any) -> Any:
    """``value`` with every float rounded to 6 significant digits (inf and NaN stay as they are)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {key: _compact(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_compact(item) for item in value]
    return value


def _fitted_link(calibration: dict[str, Any], workers: int) -> Any:
    """The cost model's link, fitted from a calibration's samples (again, so a saved run is re-analysed alike)."""

    samples = calibration["samples"]
    return fit_link([(CollectiveCall(s["kind"], s["nbytes"], workers), workers, s["seconds"]) for s in samples])


def _report(
    args: argparse.Namespace,
    measurements: dict[str, dict[str, list[dict[str, Any]]]],
    calibrations: dict[str, dict[str, Any]],
) -> None:
    """Tables, validation, JSON and plot from the measurements (fresh, or read back with ``--from-json``)."""
    results, seed_results = {}, {}
    for setting, per in measurements.items():
        rows = [combine_seeds([summarize(run, args.target, args.skip) for run in runs]) for runs in per.values()]
        workers = int(setting.split()[0])
        link = _fitted_link(calibrations[setting], workers)
        calibrations[setting].update(latency_s=link.latency_s, bytes_per_s=link.bytes_per_s)
        validate(rows, per, link, workers)
        results[setting] = rows
        seed_results[setting] = over_seeds(per, args.target, args.skip)
    load = os.getloadavg()
    text = [f"# lgc-bench network: task {args.task}, {args.steps} steps, delay {args.delay}\n"]
    for setting, rows in results.items():
        fitted = calibrations[setting]
        tables = (
            f"{step_table(rows, args.target)}\n\n{eval_line(rows)}\n\n{equal_bytes_table(rows)}\n\n"
            f"Over seeds:\n\n{seeds_table(seed_results[setting])}"
        )
        text.append(f"## {setting} per link\n\n{tables}\n")
        text.append(
            f"Cost model, link fitted on plain allreduces and allgathers: alpha {1e6 * fitted['latency_s']:.0f} us, "
            f"{8 * fitted['bytes_per_s'] / 1e6:.1f} Mbit/s.\n\n{validation_table(rows)}\n"
        )
    text.append(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    report = "\n".join(text)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "network.md").write_text(report + "\n")
        _keep(args, measurements, calibrations, results=results, over_seeds=seed_results)
        plot_results(results, args.target, args.out / "accuracy_vs_time.png")
        print(f"wrote {args.out / 'network.md'}, {RECORD} and accuracy_vs_time.png")


def _from_json(args: argparse.Namespace) -> None:
    """``--from-json``: the report of a saved record, with this version's summary and cost model."""
    saved = read_record(args.from_json)
    arguments = saved["arguments"]
    for name in ("task", "steps", "delay"):
        setattr(args, name, arguments[name])
    _report(args, saved["raw"], saved["calibrations"])
