"""Faults a run must survive: frozen and killed workers, bad checkpoints, concurrent runs.

* A frozen worker (SIGSTOP) makes the others time out after ``ddp.timeout``; the launcher exits
  with an error naming the frozen rank and leaves no worker process behind.
* A killed worker (SIGKILL) ends the run within seconds, with the signal named.
* Corrupt, truncated, unsafe or mismatched checkpoints are refused in the launching process,
  before any worker starts, with a message naming what is wrong.
* Runs started in the same second get separate folders.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train import compose_cfg

from lgc.train import train

pytestmark = pytest.mark.multiprocess


# --- hung and killed workers ------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _start_long_run(output_dir: Path, timeout_s: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lgc.train",
            "experiment=smoke",
            "logger=csv",
            f"output_dir={output_dir}",
            "trainer.max_epochs=100000",
            "trainer.limit_val_batches=0",
            f"ddp.timeout={timeout_s}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_workers(output_dir: Path, launcher: subprocess.Popen, min_step: int = 2) -> dict[int, dict]:
    """Every worker's heartbeat once both have taken ``min_step`` steps."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        try:
            beats = {r: json.loads((output_dir / ".workers" / f"rank{r}.json").read_text()) for r in range(2)}
        except (OSError, ValueError):
            beats = {}
        if len(beats) == 2 and all((b["step"] or 0) >= min_step for b in beats.values()):
            return beats
        time.sleep(0.5)
    launcher.kill()
    raise AssertionError("the workers never started training")


def _finish(launcher: subprocess.Popen, beats: dict[int, dict], started: float, limit_s: float) -> tuple[str, float]:
    try:
        output, _ = launcher.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        launcher.kill()
        for beat in beats.values():
            if _alive(beat["pid"]):
                os.kill(beat["pid"], signal.SIGKILL)
        raise AssertionError(f"the launcher did not exit within {limit_s} s") from None
    elapsed = time.monotonic() - started
    assert launcher.returncode != 0
    time.sleep(1)
    assert not [b["pid"] for b in beats.values() if _alive(b["pid"])], "worker processes were left behind"
    return output, elapsed


# Slow: torch's launcher waits 30 s for a stopped process to act on SIGTERM before it kills it.
@pytest.mark.slow
def test_a_frozen_worker_ends_the_run_after_the_timeout_naming_the_rank(tmp_path):
    timeout_s = 5
    launcher = _start_long_run(tmp_path, timeout_s)
    beats = _wait_for_workers(tmp_path, launcher)
    os.kill(beats[1]["pid"], signal.SIGSTOP)
    frozen = time.monotonic()
    # The others give up after the timeout; torch's launcher then waits 30 s for SIGTERM (which a
    # stopped process cannot act on) before it sends SIGKILL.
    output, elapsed = _finish(launcher, beats, frozen, limit_s=timeout_s + 30 + 60)
    assert re.search(r"worker rank 1 \(pid \d+ on .+\) stopped answering: its last heartbeat", output), output[-3000:]
    assert f"ddp.timeout={timeout_s} s" in output
    assert elapsed >= timeout_s


@pytest.mark.slow
def test_a_killed_worker_ends_the_run_within_seconds_and_leaves_a_checkpoint(tmp_path):
    launcher = _start_long_run(tmp_path, timeout_s=300)
    beats = _wait_for_workers(tmp_path, launcher, min_step=6)
    os.kill(beats[1]["pid"], signal.SIGKILL)
    output, elapsed = _finish(launcher, beats, time.monotonic(), limit_s=60)
    assert "SIGKILL" in output, output[-3000:]
    assert elapsed < 60
    # The epochs that ended before the kill (4 steps each) were checkpointed.
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] >= 4 and checkpoint["global_step"] % 4 == 0


# --- checkpoints checked before any worker starts -----------------------------------------------


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """A top-k run stopped after 2 of its 4 steps: its folder."""
    folder = tmp_path_factory.mktemp("stopped")
    train(compose_cfg(folder, "trainer.max_steps=2"))
    assert (folder / "checkpoints" / "last.ckpt").is_file()
    return folder


def _variant(folder: Path, name: str, edit) -> Path:
    checkpoint = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    edit(checkpoint)
    path = folder.parent / name
    torch.save(checkpoint, path)
    return path


class _Arbitrary:
    """An object only full unpickling can rebuild (what a malicious checkpoint would hold)."""


def test_corrupt_and_unsafe_files_are_refused_before_workers_start(tmp_path, stopped_run, no_workers):
    last = (stopped_run / "checkpoints" / "last.ckpt").read_bytes()
    random_bytes = tmp_path / "random.ckpt"
    random_bytes.write_bytes(random.Random(0).randbytes(4096))
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(last[: len(last) // 2])
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"state_dict": {}, "payload": _Arbitrary()}, unsafe)
    tensor = tmp_path / "tensor.ckpt"
    torch.save(torch.zeros(3), tensor)
    cases = [
        (random_bytes, "cannot be read as a torch checkpoint|holds objects other than tensors"),
        (truncated, "cannot be read as a torch checkpoint: the file is truncated"),
        (unsafe, "holds objects other than tensors and plain values.*could run arbitrary code"),
        (tensor, "holds a Tensor, not a Lightning checkpoint"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message) as refused:
            train(compose_cfg(tmp_path / "run", f"ckpt_path={path}"))
        assert "weights_only=False" not in str(refused.value)
        assert not (tmp_path / "run").exists()


def test_mismatched_checkpoints_are_refused_naming_the_mismatch(tmp_path, stopped_run, no_workers):
    last = stopped_run / "checkpoints" / "last.ckpt"
    not_lgc = _variant(stopped_run, "not_lgc.ckpt", lambda c: c.pop("lgc"))
    cases = [
        ([f"ckpt_path={not_lgc}"], "was not written by lgc-train"),
        ([f"ckpt_path={last}", "compressor=dgc"], r"another compressor configuration: compressor\._target_"),
        ([f"ckpt_path={last}", "compressor.density=0.5"], r"compressor\.density: checkpoint 0\.01, this run 0\.5"),
        ([f"ckpt_path={last}", "comm.min_numel=10"], r"comm\.min_numel: checkpoint 1024, this run 10"),
        ([f"ckpt_path={last}", "trainer.devices=1"], "written by 2 workers, this run has 1"),
        ([f"ckpt_path={last}", "model=resnet20"], r"other run settings: model\.depth: checkpoint 8, this run 20"),
        ([f"ckpt_path={last}", "trainer.max_steps=2"], "is at step 2, and this run ends at step 2: nothing is left"),
        (["optimizer.lr=-1"], "optimizer/scheduler: Invalid learning rate: -1"),
        (["ckpt_path=last"], "ckpt_path=last: no checkpoint in"),
        ([f"ckpt_path={tmp_path}"], "is a folder without any"),
    ]
    for overrides, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            train(compose_cfg(tmp_path / "run", *overrides))
        assert not (tmp_path / "run").exists()


def test_ddps_bucket_size_is_kept_on_resume_under_ddp_only():
    from lgc.lit.checkpoint import run_settings

    def settings(strategy: str, cap: float) -> dict:
        return run_settings({"strategy": {"name": strategy}, "ddp": {"bucket_cap_mb": cap}})

    assert settings("ddp", 25)["ddp"] == {"bucket_cap_mb": 25} != settings("ddp", 5)["ddp"]
    # Under FSDP2 and HSDP no DDP bucket lays out any state: not compared (nor read from older checkpoints).
    assert "ddp" not in settings("fsdp", 25) and settings("hsdp", 25) == settings("hsdp", 5)


def test_a_run_folder_or_last_names_its_newest_checkpoint(tmp_path, stopped_run):
    from lgc.lit.checkpoint import resolve_checkpoint_path

    last = stopped_run / "checkpoints" / "last.ckpt"
    assert resolve_checkpoint_path(str(stopped_run), tmp_path) == last
    assert resolve_checkpoint_path("last", stopped_run) == last
    assert resolve_checkpoint_path(str(last), tmp_path) == last
    assert resolve_checkpoint_path(None, tmp_path) is None


def test_resuming_from_a_run_folder_finishes_the_run(tmp_path, stopped_run):
    summary = train(compose_cfg(tmp_path / "resumed", f"ckpt_path={stopped_run}"))
    assert summary["steps"] == 4


# --- concurrent runs ----------------------------------------------------------------------------


@pytest.mark.slow
def test_runs_started_in_the_same_second_get_separate_folders(tmp_path):
    command = [sys.executable, "-m", "lgc.train", "--cfg", "hydra", "--resolve"]
    runs = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    folders = []
    for run in runs:
        output, _ = run.communicate(timeout=120)
        assert run.returncode == 0
        folders.append(re.search(r"^\s+dir: (outputs/\S+)$", output, re.MULTILINE).group(1))
    assert len(set(folders)) == 2, folders
    assert all(re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-[0-9a-f]{6}", f) for f in folders), folders


@pytest.mark.slow
def test_two_concurrent_training_runs_keep_their_own_summaries(tmp_path):
    command = [sys.executable, "-m", "lgc.train", "experiment=smoke", "logger=csv"]
    runs = [
        subprocess.Popen([*command, f"seed={seed}"], cwd=tmp_path, stdout=subprocess.PIPE, text=True) for seed in (0, 1)
    ]
    for run in runs:
        run.communicate(timeout=500)
        assert run.returncode == 0
    summaries = sorted(tmp_path.glob("outputs/*/*/summary.json"))
    assert len(summaries) == 2
    assert {json.loads(s.read_text())["config"]["seed"] for s in summaries} == {0, 1}
    assert all((s.parent / "checkpoints" / "last.ckpt").is_file() for s in summaries)
    assert not list(tmp_path.glob("outputs/*/*/checkpoints/last-v*.ckpt"))


def test_the_first_worker_to_go_silent_is_named(tmp_path):
    from lgc.lit.strategy import heartbeats, stalled_workers

    for rank, (at, step) in enumerate([(1000.0, 12), (700.0, 9), (998.5, 12), (650.0, 9)]):
        record = {"rank": rank, "pid": 100 + rank, "host": "h", "time": at, "step": step}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))
    (tmp_path / "rank9.json").write_text("{torn")  # a heartbeat caught mid-write is skipped
    assert [r["rank"] for r in heartbeats(tmp_path)] == [0, 1, 2, 3]
    stalled = stalled_workers(tmp_path)
    assert [(r["rank"], r["silent_s"]) for r in stalled] == [(3, 350.0), (1, 300.0)]
    assert stalled_workers(tmp_path, min_gap_s=400) == []
    assert stalled_workers(tmp_path / "none") == []


def test_any_random_bytes_are_refused_as_not_a_checkpoint(tmp_path):
    # The weights-only unpickler fails on random input in many ways (IndexError, UnpicklingError,
    # RuntimeError, ...); each must come out as the same clear error naming the file.
    from lgc.lit.checkpoint import load_checkpoint

    for seed in range(40):
        path = tmp_path / f"random{seed}.ckpt"
        path.write_bytes(random.Random(seed).randbytes(64 + 97 * seed))
        with pytest.raises(ValueError, match=rf"ckpt_path='{re.escape(str(path))}' (cannot be read|holds objects)"):
            load_checkpoint(path)
