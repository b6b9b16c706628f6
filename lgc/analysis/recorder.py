"""A Lightning callback that records every worker's own gradients, before DDP averages them.

Each rank writes ``rank{r}.pt`` into ``output_dir`` at the end of training;
:func:`lgc.analysis.load_recording` reads a folder of them back as one
:class:`~lgc.analysis.GradientRecording` with a leading worker dimension.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from lgc.analysis.recording import RECORDING_FORMAT, rank_file
from lgc.validation import PositiveInt, check

__all__ = ["GradientRecorder", "select_parameters"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def select_parameters(
    named_parameters: Iterable[tuple[str, nn.Parameter]], patterns: Sequence[str] | None = None
) -> dict[str, nn.Parameter]:
    """The parameters whose names match any of ``patterns`` (``fnmatch`` globs), in model order.

    ``patterns=None`` picks a few convolution weights: the first, the middle and the last 4-D
    parameter (stem, a middle block, the last block: layers whose gradients behave differently).
    Raises ``ValueError`` naming the patterns when nothing matches.
    """
    named = [(name, p) for name, p in named_parameters if p.requires_grad]
    if patterns is None:
        convs = [(name, p) for name, p in named if p.dim() == 4]
        if not convs:
            raise ValueError("the model has no convolution weights; pass parameter name patterns")
        picked = sorted({0, len(convs) // 2, len(convs) - 1})
        return {convs[i][0]: convs[i][1] for i in picked}
    if isinstance(patterns, str):
        patterns = [patterns]
    selected = {name: p for name, p in named if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)}
    if not selected:
        examples = ", ".join(name for name, _ in named[:6])
        raise ValueError(f"no parameter name matches {list(patterns)!r} (names look like: {examples}, ...)")
    return selected


class GradientRecorder(pl.Callback):
    """Saves this worker's local gradient of selected parameters every ``every_n_steps`` steps.

    A tensor hook (``param.register_hook``) sees the gradient that backward computed on this rank,
    before DDP's reducer copies it into a bucket and averages it across ranks. The hook only copies
    it (it returns None, so the gradient and hence training are unchanged). With gradient
    accumulation the micro-batches' gradients are summed, which is what DDP communicates at the
    step. Recordings are kept in host memory until the end of training, so pick layers and
    ``every_n_steps`` with the size in mind (``numel * steps / every_n_steps * bytes per element``).

    File ``output_dir/rank{r}.pt`` (one per rank, written at the end of training)::

        {"format": 1, "rank": r, "world_size": W, "steps": LongTensor[T],
         "gradients": {name: Tensor[T, *param.shape]}, "metadata": {...}}

    Args:
        output_dir: folder for the per-rank files (created).
        patterns: ``fnmatch`` globs over the LightningModule's parameter names, e.g.
            ``["model.layers.*.conv1.weight"]``; None picks the first, middle and last conv weight.
        every_n_steps: record optimizer steps ``0, n, 2n, ...`` (Lightning's ``global_step``).
        dtype: ``"float32"``, or ``"float16"``/``"bfloat16"`` to halve the size of the files.
        metadata: anything to store with the recording (e.g. the data partition).

    Example::

        >>> trainer = pl.Trainer(devices=2, callbacks=[GradientRecorder("grads", every_n_steps=5)], ...)
        >>> trainer.fit(module, datamodule)
        >>> recording = load_recording("grads")  # gradients[name]: [workers, steps, *shape]
    """

    def __init__(
        self,
        output_dir: str,
        patterns: Sequence[str] | None = None,
        every_n_steps: PositiveInt = 1,
        dtype: str = "float32",
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        check("every_n_steps", every_n_steps, PositiveInt)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
        self.output_dir = str(output_dir)
        self.patterns = None if patterns is None else [patterns] if isinstance(patterns, str) else _plain(patterns)
        self.every_n_steps = every_n_steps
        self.dtype = dtype
        # Plain containers (not OmegaConf's), so the files load with torch.load(weights_only=True).
        self.metadata = _plain(dict(metadata or {}))
        # Internal state, rebuilt in every worker process at the start of training.
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # Whether the current batch's backward is recorded (hooks also fire outside training steps).
        self._recording = False
        # This step's gradients so far (summed over accumulated micro-batches), by parameter name.
        self._pending: dict[str, Tensor] = {}
        self._pending_step = -1
        self._steps: list[int] = []
        self._records: dict[str, list[Tensor]] = {}

    @property
    def path(self) -> Path:
        """The folder the per-rank files go to."""
        return Path(self.output_dir)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        self._steps, self._pending, self._pending_step, self._recording = [], {}, -1, False
        selected = select_parameters(pl_module.named_parameters(), self.patterns)
        self._records = {name: [] for name in selected}
        for name, param in selected.items():
            self._handles.append(param.register_hook(self._hook_for(name)))

    def _hook_for(self, name: str) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if not self._recording:
                return
            # Summed in float32 over micro-batches; converted to `dtype` once the step is complete.
            local = grad.detach().to(device="cpu", dtype=torch.float32, copy=True)
            self._pending[name] = local if name not in self._pending else self._pending[name] + local

        return hook

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._pending_step:
            # A new optimizer step: drop what a skipped step (e.g. an AMP overflow) left behind.
            self._pending, self._pending_step = {}, trainer.global_step
        self._recording = trainer.global_step % self.every_n_steps == 0

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # All backward passes of this step are done (and DDP has averaged .grad; we kept our copies).
        if not self._recording or not self._pending:
            return
        missing = self._records.keys() - self._pending.keys()
        if missing:
            raise RuntimeError(f"no gradient reached {sorted(missing)} at step {trainer.global_step}")
        self._steps.append(trainer.global_step)
        for name, grad in self._pending.items():
            self._records[name].append(grad.to(_DTYPES[self.dtype]))
        self._pending, self._recording = {}, False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        self.path.mkdir(parents=True, exist_ok=True)
        record = {
            "format": RECORDING_FORMAT,
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "steps": torch.tensor(self._steps, dtype=torch.int64),
            "gradients": {
                name: torch.stack(grads) if grads else torch.empty(0) for name, grads in self._records.items()
            },
            "metadata": self.metadata,
        }
        torch.save(record, rank_file(self.path, trainer.global_rank))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
