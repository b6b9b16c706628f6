"""A Lightning DDP strategy that really registers the compression hook, on every backend.

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only when the device is CUDA;
on CPU (gloo) it trains uncompressed without a word. :class:`CompressedDDPStrategy` registers
:func:`lgc.ddp.compression_hook` on gloo and NCCL alike, and fails at the end of fit if the hook
never ran.

Hung workers: the process group gets ``timeout`` (Lightning's ``DDPStrategy`` passes it to gloo and
NCCL; NCCL's asynchronous error handling is switched on), so a rank that stops answering makes the
others fail after that long instead of waiting forever. Each worker writes a heartbeat file (a
thread, once a second) into ``heartbeat_dir``; :func:`stalled_workers` reads them afterwards to name
the rank that stopped first.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy

from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.ddp.torch_hooks import TorchHookState

__all__ = ["CompressedDDPStrategy", "WorkerChecks", "heartbeats", "stalled_workers"]

#: Seconds between heartbeats; a worker silent for much longer than this while others went on was stalled.
HEARTBEAT_INTERVAL_S = 1.0


class _Heartbeat(threading.Thread):
    """Writes ``rank{R}.json`` (pid, host, time, step) every ``interval`` seconds until stopped.

    A thread keeps beating while its process waits in a collective (waits release the GIL); it
    stops when the process is frozen (SIGSTOP, a debugger, swapped out) or dead.
    """

    def __init__(self, folder: Path, rank: int, step: Any, interval: float = HEARTBEAT_INTERVAL_S) -> None:
        super().__init__(name=f"lgc-heartbeat-{rank}", daemon=True)
        self.path = folder / f"rank{rank}.json"
        self.rank = rank
        self.step = step
        self.interval = interval
        self.stopped = threading.Event()
        folder.mkdir(parents=True, exist_ok=True)
        self.beat()

    def beat(self) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
        record["step"] = self.step()
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(record))
        os.replace(partial, self.path)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.beat()
            except OSError:  # the run folder went away: nothing left to report to
                return


def heartbeats(folder: str | Path) -> list[dict[str, Any]]:
    """Every worker's last heartbeat record in ``folder`` (``rank``, ``pid``, ``host``, ``time``, ``step``)."""
    records = []
    for path in sorted(Path(folder).glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def stalled_workers(folder: str | Path, min_gap_s: float = 5 * HEARTBEAT_INTERVAL_S) -> list[dict[str, Any]]:
    """Workers whose heartbeat stopped more than ``min_gap_s`` before the latest one, oldest first.

    Each is its heartbeat record (:func:`heartbeats`) plus ``silent_s``, how long before the last
    worker's last heartbeat it went silent. A record's step is up to a heartbeat interval old.
    """
    records = heartbeats(folder)
    if len(records) < 2:
        return []
    latest = max(record["time"] for record in records)
    stalled = [{**r, "silent_s": latest - r["time"]} for r in records if latest - r["time"] > min_gap_s]
    return sorted(stalled, key=lambda r: r["time"])


class WorkerChecks:
    """What lgc's strategies share: the checkpoint callback required, heartbeats, and a loud end if no hook ran.

    Mixed into a Lightning strategy that has ``hook_state`` and ``heartbeat_dir``.
    """

    hook_state: Any
    heartbeat_dir: Path | None
    _heartbeat: _Heartbeat | None = None
    #: What compresses the gradients, for the end-of-fit check's message.
    reduction: str

    def teardown(self) -> None:
        self.stop_heartbeat()
        super().teardown()  # type: ignore[misc]

    def on_train_end(self) -> None:
        super().on_train_end()  # type: ignore[misc]
        self.check_hook_ran(self.reduction)

    def require_compression_callback(self) -> None:
        """Refuse to train without :class:`lgc.lit.CompressionCallback` (checked before the process group exists:
        Lightning never destroys it, and one left behind in this process would hold MASTER_PORT)."""
        from lgc.lit.callbacks import CompressionCallback

        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if not any(isinstance(cb, CompressionCallback) for cb in trainer.callbacks):
            raise ValueError(
                f"{type(self).__name__} needs lgc.lit.CompressionCallback in Trainer(callbacks=...) so that every "
                "rank's compressor state (residuals) is checkpointed"
            )
        # NCCL: a timed-out collective aborts the communicator and ends the process instead of hanging.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")

    def start_heartbeat(self) -> None:
        """This worker's heartbeat thread, once the ranks are known (when ``heartbeat_dir`` is set)."""
        if self.heartbeat_dir is not None:
            trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
            rank = self.global_rank  # type: ignore[attr-defined]
            self._heartbeat = _Heartbeat(self.heartbeat_dir, rank, step=lambda: trainer.global_step)
            self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stopped.set()
            self._heartbeat = None

    def check_hook_ran(self, what: str) -> None:
        """At the end of fit: raise if steps were taken but ``what`` (the compressed reduction) never ran."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if trainer.global_step > 0 and self.hook_state.stats.hook_calls == 0:
            raise RuntimeError(
                f"{self.hook_state.describe()} was configured but {what} never ran in "
                f"{trainer.global_step} steps: gradients were averaged uncompressed"
            )


class CompressedDDPStrategy(WorkerChecks, DDPStrategy):
    """DDP whose gradient averaging goes through ``hook_state.compressor``.

    Add :class:`lgc.lit.CompressionCallback` to the trainer too: it logs the ``comm/*`` metrics and
    puts every rank's compressor state into checkpoints (the strategy refuses to train without it,
    because a checkpoint without residuals cannot resume exactly).

    Args:
        hook_state: the compressor and hook knobs, e.g.
            ``CompressionHookState(ErrorFeedback(TopKCompressor(0.01)), min_numel=1024)``, or one of
            PyTorch's own hooks wrapped by :mod:`lgc.ddp.torch_hooks` (``PowerSGDHookState()``).
        heartbeat_dir: where every worker writes its heartbeat (see :func:`stalled_workers`); None
            writes none.
        **kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``, ``process_group_backend``,
            ``bucket_cap_mb``, ``timeout`` of every collective, ...); ``ddp_comm_hook`` is not accepted.

    Example::

        >>> state = CompressionHookState(ErrorFeedback(TopKCompressor(density=0.01)))
        >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=CompressedDDPStrategy(state),
        ...                      callbacks=[CompressionCallback()])
    """

    strategy_name = "lgc_ddp"
    reduction = "the DDP communication hook"

    def __init__(
        self,
        hook_state: CompressionHookState | TorchHookState | CommunicationDelayState,
        heartbeat_dir: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        for key in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if kwargs.get(key) is not None:
                raise ValueError(f"CompressedDDPStrategy registers its own hook; do not pass {key}={kwargs[key]!r}")
        timeout = kwargs.get("timeout")
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
        super().__init__(**kwargs)
        self.hook_state = hook_state
        self.heartbeat_dir = None if heartbeat_dir is None else Path(heartbeat_dir)

    def setup_environment(self) -> None:
        self.require_compression_callback()
        super().setup_environment()
        self.start_heartbeat()

    def _register_ddp_hooks(self) -> None:
        # Deliberately not Lightning's CUDA-only path: register on gloo and NCCL alike.
        self.hook_state.process_group = dist.group.WORLD
        self.hook_state.register(self.model)
