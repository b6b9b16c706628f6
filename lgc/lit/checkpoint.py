"""Checkpoints that resume exactly, and that are checked before any worker starts.

* :class:`ResumableCheckpoint`: Lightning's ``ModelCheckpoint`` keeping ``last.ckpt``, except that
  a run stopped by ``trainer.max_steps`` in the middle of an epoch saves its state *at that step*
  (Lightning's own saves it as if the epoch had ended, and a resumed run then skips the rest of the
  epoch without a word). Optionally every ``every_n_train_steps`` steps, for pre-emptible jobs.
* :class:`CheckpointRecord`: writes ``checkpoint["lgc"]``, what made the checkpoint (compressor and
  communication config, world size, lgc version), so that :func:`check_checkpoint` can refuse a
  mismatched resume in the launching process.
* :func:`rng_state` / :func:`set_rng_state`: a rank's random generators as plain tensors and numbers
  (loadable with ``torch.load(weights_only=True)``); :class:`lgc.lit.CompressionCallback` keeps one
  per rank in every checkpoint.
* :func:`metric_states` / :func:`load_metric_states`: a rank's torchmetrics accumulators (an
  epoch's ``train/acc`` so far), also kept per rank: Lightning saves none of them.

Together with the stateful training loaders of :mod:`lgc.lit.data` (data position) and
:class:`lgc.lit.CompressionCallback` (every rank's compressor state), a run resumed from any
``last.ckpt``, at an epoch's end or in its middle, takes bit-identical steps to one never stopped,
also where Lightning alone would not: an epoch-end checkpoint of a run with ``trainer.max_steps``
(:meth:`ResumableCheckpoint.on_load_checkpoint`).

Why one module: what a checkpoint holds (the saving callback, the record it carries, the random
generators) and what a resume checks against it (:func:`check_checkpoint`, :func:`run_settings`) are
one contract; split, a setting recorded on one side could go unchecked on the other.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointRecord",
    "ResumableCheckpoint",
    "check_checkpoint",
    "load_checkpoint",
    "load_metric_states",
    "metric_states",
    "load_own_optimizer_state",
    "own_optimizer_state",
    "resolve_checkpoint_path",
    "run_settings",
    "rng_state",
    "set_rng_state",
]

#: The ``strategy`` record of a DDP run (and of checkpoints written before strategies were recorded).
DDP_STRATEGY: dict[str, Any] = {"name": "ddp"}

#: Version of ``checkpoint["lgc"]``; a checkpoint of another format is refused with this number named.
CHECKPOINT_FORMAT = 1


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, numpy and Python random generators, as tensors and plain numbers."""
    version, keys, gauss = random.getstate()
    name, mt, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(mt, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": int(version), "keys": torch.tensor(keys, dtype=torch.int64), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def own_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state in plain tensors: under FSDP2 a sharded parameter's state (its momentum, a
    DTensor) by this rank's shard, so that the checkpoint loads without a process group."""
    state = optimizer.state_dict()
    own = {
        index: {key: value.to_local() if isinstance(value, DTensor) else value for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
    return {**state, "state": own}


def load_own_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`own_optimizer_state`'s result: a shard of a sharded parameter's state (a tensor of its local
    shape, not a 0-dim step count) becomes that parameter's DTensor again."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    entries = {}
    for index, entry in state["state"].items():
        param = params[int(index)]
        if isinstance(param, DTensor):
            local_shape = param.to_local().shape
            entry = {
                key: DTensor.from_local(
                    value,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local_shape
                else value
                for key, value in entry.items()
            }
        entries[index] = entry
    optimizer.load_state_dict({**state, "state": entries})


def metric_states(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Every torchmetrics ``Metric`` of ``module`` by name: its accumulated states (on the CPU) and
    update count. A checkpoint taken in the middle of an epoch holds the epoch's counts so far, which
    differ per rank; one taken between epochs holds reset metrics."""
    from torchmetrics import Metric

    def cpu(value: Any) -> Any:
        return [v.detach().cpu().clone() for v in value] if isinstance(value, list) else value.detach().cpu().clone()

    return {
        name: {"state": {key: cpu(value) for key, value in metric.metric_state.items()}, "updates": metric.update_count}
        for name, metric in module.named_modules()
        if isinstance(metric, Metric)
    }


def load_metric_states(module: torch.nn.Module, states: dict[str, dict[str, Any]]) -> None:
    """Put back what :func:`metric_states` returned, on each metric's device; a metric the module
    has and ``states`` lacks (a checkpoint of a module without it) is refused, naming it."""
    from torchmetrics import Metric

    metrics = {name: metric for name, metric in module.named_modules() if isinstance(metric, Metric)}
    if set(metrics) != set(states):
        raise ValueError(f"the checkpoint holds the metrics {sorted(states)}, this module has {sorted(metrics)}")
    for name, metric in metrics.items():
        for key, value in states[name]["state"].items():
            moved = [v.to(metric.device) for v in value] if isinstance(value, list) else value.to(metric.device)
            setattr(metric, key, moved)
        metric._update_count = int(states[name]["updates"])
        metric._computed = None


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` returned (in the same process kind: CUDA only where saved)."""
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["name"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["keys"].tolist()), python_state["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class ResumableCheckpoint(ModelCheckpoint):
    """``last.ckpt`` at every epoch's end, at the step where ``trainer.max_steps`` stops a run, and every n steps.

    Lightning's ``ModelCheckpoint(save_last=True, save_top_k=0)`` writes ``last.ckpt`` only when
    training ends, so a killed or pre-empted run has none; and a run stopped by ``max_steps`` in
    mid-epoch is saved with the epoch recorded as finished, so resuming it skips the epoch's remaining
    batches (a 24-step run stopped at 12 and resumed ended after 20). This one saves at every
    epoch's end, and in mid-epoch at the step itself (as Lightning's step checkpoints are), which
    resumes mid-epoch (the data position comes from the stateful loader). A step that ends an epoch
    is saved at the epoch's end only: a checkpoint taken at the last batch resumes without the
    epoch's learning-rate step.

    Args:
        dirpath: folder of ``last.ckpt``.
        every_n_train_steps: also save ``last.ckpt`` every this many optimizer steps (pre-emptible
            jobs lose at most that many); None saves at epoch ends and at the final step only.
    """

    def __init__(self, dirpath: str | Path, every_n_train_steps: int | None = None) -> None:
        steps = every_n_train_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"checkpoint.every_n_train_steps must be a positive integer or null, got {steps!r}")
        # No last-v1.ckpt beside last.ckpt when a run resumes into its own folder: it goes on writing last.ckpt.
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, enable_version_counter=False)
        self.every_n_steps = steps

    def _save_last(self, trainer: pl.Trainer) -> None:
        # Skipped when this step is saved already (also marks it saved, for the saves that follow).
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # saved at the epoch's end
        step = trainer.global_step
        due = self.every_n_steps is not None and step % self.every_n_steps == 0
        if due or 0 < trainer.max_steps <= step:
            self._save_last(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save_last(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # no metric-based checkpoints: every save is above

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Runs before Lightning restores its loops from ``checkpoint["loops"]``.
        self._resumes_finished_epoch = trainer.max_steps != -1 and _finish_saved_epoch(checkpoint)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if getattr(self, "_resumes_finished_epoch", False):
            # The epoch loop starts its next epoch as a fresh one (counters, validation) would.
            trainer.fit_loop.epoch_loop.restarting = False
            self._resumes_finished_epoch = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning's version restores the best/last paths of the stopped run and warns when a
        # resumed run writes to a new folder, as lgc-train's always do; with save_top_k=0 there is
        # nothing to restore.
        pass


def _finish_saved_epoch(checkpoint: dict[str, Any]) -> bool:
    """Rewrite the loop state of a checkpoint saved at an epoch's end as that of a finished epoch.

    Lightning saves ``on_train_epoch_end`` checkpoints before it counts the epoch completed. A run
    without ``max_steps`` resumes them as finished epochs; with ``max_steps`` (iteration-based
    training) Lightning restarts them as unfinished: the resumed run passes through an empty epoch
    and numbers, and shuffles, every later epoch one higher. Here the epoch is counted completed and
    the training loader's saved position (the end of that epoch) dropped, so the next epoch begins as
    in a run never stopped. Returns whether the checkpoint was such an epoch-end save.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    if not fit_loop or "epoch_progress" not in fit_loop:
        return False
    epochs = fit_loop["epoch_progress"]["total"]
    batches = fit_loop["epoch_loop.batch_progress"]["total"]
    saved_at_epoch_end = (
        epochs["ready"] == epochs["started"] == epochs["processed"] == epochs["completed"] + 1
        and batches["ready"] == batches["started"] == batches["processed"] == batches["completed"]
    )
    if saved_at_epoch_end:
        for counts in fit_loop["epoch_progress"].values():
            counts["completed"] = counts["processed"]
        fit_loop.get("state_dict", {}).pop("combined_loader", None)
    return saved_at_epoch_end


class CheckpointRecord(pl.Callback):
    """Writes ``checkpoint["lgc"]``: what a resumed run must match (checked by :func:`check_checkpoint`).

    Args:
        compressor: the resolved ``compressor`` config node.
        comm: the resolved ``comm`` config node.
        strategy: the resolved ``strategy`` config node (DDP, FSDP2 or HSDP); None: DDP.
        run: the settings that fix the run's course besides those (:func:`run_settings`); None: not recorded.
    """

    def __init__(
        self,
        compressor: dict[str, Any],
        comm: dict[str, Any],
        strategy: dict[str, Any] | None = None,
        run: dict[str, Any] | None = None,
    ) -> None:
        self.compressor = compressor
        self.comm = comm
        self.strategy = DDP_STRATEGY if strategy is None else strategy
        self.run = run

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        from lgc import __version__

        checkpoint["lgc"] = {
            "format": CHECKPOINT_FORMAT,
            "version": __version__,
            "world_size": trainer.world_size,
            "compressor": self.compressor,
            "comm": self.comm,
            "strategy": self.strategy,
            **({} if self.run is None else {"run": self.run}),
        }


#: Data settings that name where the data is or how it is read, not which data: they may change on a resume
#: (``num_workers`` is compared apart, as the loader's: its saved position is laid out by its worker processes).
_DATA_LOCATION = ("root", "download", "num_workers", "cache")


def run_settings(resolved: dict[str, Any]) -> dict[str, Any]:
    """What a resumed run must keep, from the resolved config, besides the compressor, ``comm`` and strategy:
    the data (which images, in which shards and batches; not where they lie), the seed, the optimizer
    and the learning-rate schedule (the checkpoint restores their state over any new setting: a
    cosine schedule keeps its length) and, under DDP, its buckets (PowerSGD's state is laid out by them). The
    run's length may change where the schedule does not follow it. Also what else changes the steps: the
    model's config, the loss, the trainer's precision, gradient clipping, accumulation and epoch length,
    and whether the training loader reads in worker processes (its saved position is laid out by them)."""
    data = {key: value for key, value in (resolved.get("data") or {}).items() if key not in _DATA_LOCATION}
    trainer = resolved.get("trainer") or {}
    settings = {
        "data": data,
        "seed": resolved.get("seed"),
        "optimizer": resolved.get("optimizer"),
        "scheduler": resolved.get("scheduler"),
        "ddp": {"bucket_cap_mb": (resolved.get("ddp") or {}).get("bucket_cap_mb")},
        "model": resolved.get("model"),
        "loss": resolved.get("loss"),
        "trainer": {key: trainer.get(key) for key in _TRAINER_STEP_SETTINGS},
        "loader": {"num_workers": (resolved.get("data") or {}).get("num_workers")},
    }
    if (resolved.get("strategy") or DDP_STRATEGY).get("name", "ddp") != "ddp":
        del settings["ddp"]  # FSDP2 and HSDP code every parameter's gradient whole, in no DDP bucket
    return settings


#: The trainer's settings that change what a step computes or which batches an epoch holds.
_TRAINER_STEP_SETTINGS = (
    "precision",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "accumulate_grad_batches",
    "limit_train_batches",
)


def resolve_checkpoint_path(value: str | Path | None, output_dir: str | Path) -> Path | None:
    """The checkpoint file ``ckpt_path=value`` means.

    * a file: itself;
    * a folder: its newest checkpoint (a run folder's ``checkpoints/``, or ``*.ckpt`` in it), so a
      run folder can be named without Lightning's ``=``-holding file names (which Hydra's command
      line refuses unless quoted: ``'ckpt_path="path/epoch=1-step=20.ckpt"'``);
    * ``last``: the newest checkpoint of this run's ``output_dir`` (with ``hydra.run.dir`` pinned to
      the stopped run's folder).
    """
    if value is None:
        return None
    if str(value) == "last":
        found = _newest_checkpoint(Path(output_dir))
        if found is None:
            raise FileNotFoundError(
                f"ckpt_path=last: no checkpoint in {Path(output_dir) / 'checkpoints'} (this run's folder). Name the "
                "stopped run's folder instead (ckpt_path=outputs/DATE/TIME-ID), or pin hydra.run.dir to it"
            )
        return found
    path = Path(value).expanduser()
    if path.is_dir():
        found = _newest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"ckpt_path={str(value)!r} is a folder without any *.ckpt file")
        return found
    if not path.is_file():
        raise FileNotFoundError(f"ckpt_path={str(value)!r} is not a file")
    return path


def _newest_checkpoint(folder: Path) -> Path | None:
    candidates = [*(folder / "checkpoints").glob("*.ckpt"), *folder.glob("*.ckpt")]
    return max(candidates, key=lambda p: p.stat().st_mtime_ns, default=None)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` on CPU; a file that is not a checkpoint gets a clear error.

    Never loads arbitrary pickled objects: a file that needs them is refused, not retried unsafely.
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"ckpt_path={str(path)!r} holds objects other than tensors and plain values, so it is not a checkpoint "
            f"lgc wrote; it is refused because loading it could run arbitrary code ({str(err).splitlines()[0]})"
        ) from err
    except Exception as err:  # noqa: BLE001 - random bytes make the unpickler fail in many ways (IndexError, ...)
        raise ValueError(
            f"ckpt_path={str(path)!r} cannot be read as a torch checkpoint: the file is truncated, corrupted or of "
            f"another kind ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'})"
        ) from err
    if not isinstance(checkpoint, dict):
        raise ValueError(f"ckpt_path={str(path)!r} holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
    return checkpoint


def _differences(saved: Any, current: Any, prefix: str) -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        lines = []
        for key in sorted(set(saved) | set(current), key=str):
            lines += _differences(saved.get(key, "<absent>"), current.get(key, "<absent>"), f"{prefix}.{key}")
        return lines
    return [] if saved == current else [f"{prefix}: checkpoint {saved!r}, this run {current!r}"]


def check_checkpoint(
    path: str | Path,
    *,
    compressor: dict[str, Any],
    comm: dict[str, Any],
    world_size: int,
    model_state: dict[str, torch.Tensor],
    total_steps: int | None = None,
    strategy: dict[str, Any] | None = None,
    run: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load ``path`` safely and check that this run can resume from it; returns the checkpoint.

    Refused with a :class:`ValueError` naming the mismatch: a file that is not a torch checkpoint
    or needs unsafe loading, one not written by ``lgc-train``, another compressor or ``comm`` config
    (compressor state would not fit, or would silently mean something else), another world size
    (every rank's residuals are saved), another model (parameter names or shapes), or a checkpoint
    that has already taken every step this run would take.

    Args:
        path: the checkpoint file.
        compressor: this run's resolved ``compressor`` config node.
        comm: this run's resolved ``comm`` config node.
        world_size: this run's number of workers.
        model_state: this run's LightningModule ``state_dict()`` (names and shapes are compared).
        total_steps: the optimizer steps this run would end at, when known.
        strategy: this run's resolved ``strategy`` config node; None: DDP (a checkpoint without one is DDP's).
        run: this run's :func:`run_settings`, compared with the checkpoint's where it recorded them.
    """
    checkpoint = load_checkpoint(path)
    name = f"ckpt_path={str(path)!r}"
    record = checkpoint.get("lgc")
    if not isinstance(record, dict) or "CompressionCallback" not in checkpoint.get("callbacks", {}):
        raise ValueError(f"{name} was not written by lgc-train (it has no lgc record or compressor state)")
    if record.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{name} has lgc checkpoint format {record.get('format')!r}; this lgc reads {CHECKPOINT_FORMAT}"
        )
    if record["world_size"] != world_size:
        raise ValueError(
            f"{name} was written by {record['world_size']} workers, this run has {world_size}: every rank's "
            "compressor state (residuals) is in it, so resume with the same number of workers"
        )
    saved_strategy = record.get("strategy", DDP_STRATEGY)
    if saved_strategy != (DDP_STRATEGY if strategy is None else strategy):
        raise ValueError(
            f"{name} was written under strategy {saved_strategy}, this run has {strategy}: the optimizer state and "
            "every rank's compressor state are laid out by it, so resume under the same strategy"
        )
    differences = _differences(record["compressor"], compressor, "compressor") + _differences(
        record["comm"], comm, "comm"
    )
    if differences:
        raise ValueError(f"{name} was written with another compressor configuration: " + "; ".join(differences))
    if run is not None and isinstance(record.get("run"), dict):
        # The settings the checkpoint recorded (one written before a setting was recorded is compared on the rest).
        recorded = [key for key in sorted(run) if key in record["run"]]
        changed = [line for key in recorded for line in _differences(record["run"][key], run[key], key)]
        if changed:
            raise ValueError(
                f"{name} was written with other run settings: {'; '.join(changed)}; a resume takes the steps of "
                "the run that stopped, so resume with its settings (or start a new run)"
            )
    saved_shapes = {key: tuple(value.shape) for key, value in checkpoint.get("state_dict", {}).items()}
    current_shapes = {key: tuple(value.shape) for key, value in model_state.items()}
    if saved_shapes != current_shapes:
        missing = sorted(set(current_shapes) - set(saved_shapes))
        extra = sorted(set(saved_shapes) - set(current_shapes))
        reshaped = sorted(k for k in set(saved_shapes) & set(current_shapes) if saved_shapes[k] != current_shapes[k])
        parts = []
        if missing:
            parts.append(f"{len(missing)} of this model's tensors are not in it (first: {missing[0]})")
        if extra:
            parts.append(f"it has {len(extra)} tensors this model lacks (first: {extra[0]})")
        if reshaped:
            key = reshaped[0]
            parts.append(
                f"{len(reshaped)} tensors differ in shape (first: {key}, checkpoint {saved_shapes[key]}, "
                f"this model {current_shapes[key]})"
            )
        raise ValueError(f"{name} holds another model: " + "; ".join(parts))
    step = checkpoint.get("global_step", 0)
    if total_steps is not None and step >= total_steps:
        raise ValueError(
            f"{name} is at step {step}, and this run ends at step {total_steps}: nothing is left to train; "
            "raise trainer.max_steps or trainer.max_epochs to go on, where the learning-rate schedule does not "
            "follow them (the checkpoint's schedule would be kept)"
        )
    return checkpoint
