"""``lgc.compress``: the one way to put any lgc method on a DistributedDataParallel or FSDP2 model.

Every method of ``lgc/conf/compressor/`` is available by name with its paper's defaults, or by
object (a :class:`~lgc.compressors.Compressor`, or a hook state built by hand). The call checks what
a plain DDP script gets wrong silently and refuses it with a message that says what to change:

* a model that is not :class:`~torch.nn.parallel.DistributedDataParallel`, or no process group;
* a sparsifier (top-k, SBC, RedSync, random block) or EF-signSGD without error feedback: what it
  does not send would be dropped, not delayed; ``error_feedback=False`` says that is meant;
* :class:`~lgc.compressors.ErrorFeedback` around DGC, which keeps its own;
* DGC next to an optimizer that applies momentum, or weight decay that DGC applies as well
  (:meth:`lgc.compressors.DGCCompressor.check_optimizer`, the rules ``lgc-train`` applies
  too; DeMo's likewise), and DGC's per-epoch warm-up
  with neither ``steps_per_epoch`` nor ``state.set_epoch`` to advance it (refused at its first
  compressed step, where it is known that nothing called ``set_epoch``);
* communication delay whose ``after_optimizer_step()`` is forgotten (workers would drift apart
  without ever exchanging) or called twice per step.

The registry :data:`~lgc.methods.METHODS` reads every name's class, knobs and error feedback from
the packaged yaml, and :func:`lgc.methods.build_hook_state` builds the state, so the Hydra command
``lgc-train compressor=NAME`` and ``lgc.compress(model, NAME)`` build the same thing without the
core importing Hydra.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors import Compressor
from lgc.ddp.protocol import HookState
from lgc.fsdp import check_fsdp_settings, check_sharded, register_sharded, replicate_group_of
from lgc.methods import METHODS, Comm, build_hook_state, check_error_feedback, optimizer_rules_owner

__all__ = ["METHODS", "HookState", "check_sharded_method", "compress"]


def compress(
    model: DistributedDataParallel | FSDPModule,
    method: str | Compressor | HookState,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    error_feedback: bool | None = None,
    error_decay: float | None = None,
    delay: int | None = None,
    outer: str | None = None,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    fragments: int | None = None,
    fragment_split: str | None = None,
    overlap_steps: int | None = None,
    mixing: float | None = None,
    min_numel: int | None = None,
    start_iter: int | None = None,
    overlap: bool | None = None,
    pack: bool | None = None,
    buffers: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    replicate: DeviceMesh | dist.ProcessGroup | None = None,
    optimizer_momentum: float | None = None,
    optimizer_weight_decay: float | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    **knobs: Any,
) -> HookState:
    """Make ``model`` communicate through ``method``: register the hook and return its state.

    Call it in every worker, after ``dist.init_process_group`` and ``DistributedDataParallel(...)``,
    before the first backward pass; then train as usual.

    An FSDP2 model (``fully_shard``, whose root is ``model``) gets lgc's reduce-scatter in every
    parameter group (:mod:`lgc.fsdp`): each rank compresses every gradient whole, as the DDP hook does,
    and keeps its shard of the sum; every per-step lgc compressor runs there, bitwise as under DDP
    (``tests/fsdp/``). FSDP2 takes no ``process_group`` (its mesh decides), ``overlap`` nor
    ``pack``, and runs no hook state with collectives of its own (PyTorch's DDP hooks): each is
    refused, naming it. Hybrid sharding (HSDP): shard over the shard dimension and pass
    ``replicate``; the all-reduce across replicas is then the compressed one, with ``delay`` the
    replicas are the local-step family's workers (:mod:`lgc.fsdp.local_steps`), and LGC's family
    (``"lgc_rar"``, ``"lgc_ps"``, the shared-index codecs) codes that all-reduce, one codec per
    shard position (:mod:`lgc.fsdp.learned`); without ``replicate`` LGC is refused.

    Compiled models train through the hook, every method (``tests/ddp/test_compile.py``):
    ``DistributedDataParallel(torch.compile(net))``; ``torch.compile`` of the DDP model is taken as
    the DDP model it wraps.

    Args:
        model: the :class:`~torch.nn.parallel.DistributedDataParallel` model, or ``torch.compile`` of it; or
            the root of an FSDP2 model (``fully_shard(model)`` after its blocks).
        method: a name of :data:`METHODS` (``"topk"``, ``"dgc"``, ``"lgc_rar"``, ``"powersgd"``, ...: the
            configs of ``lgc/conf/compressor/``, with their paper's defaults), a
            :class:`~lgc.compressors.Compressor` (e.g. ``ErrorFeedback(TopKCompressor(0.01))``), or a
            hook state built by hand (registered as it is; it carries its own configuration).
        optimizer: the optimizer that steps ``model``. DGC checks it applies no momentum (and no
            weight decay when DGC applies its own); with ``delay`` it calls
            ``state.after_optimizer_step()`` after every ``optimizer.step()``.
        error_feedback: by name, ``None`` follows the yaml (on for topk, sbc, redsync, random_block,
            signsgd). ``True`` wraps the compressor in :class:`~lgc.compressors.ErrorFeedback`;
            ``False`` runs a sparsifier without it (refused unless said explicitly: the unsent part
            is lost). Refused for DGC, LGC and PyTorch's hooks, which keep their own.
        error_decay: error feedback's residual decay ``beta`` in ``v = beta * r + g``; ``None``
            follows the yaml (``sparseloco``: 0.95, ``demo``: 0.999, else 1: nothing fades).
        delay: SBC's communication delay: ``delay`` local optimizer steps, then the workers
            exchange their weight updates through the compressor (:mod:`lgc.ddp.local_sgd`), or
            through LGC's family (``"lgc_rar"``, ``"shared_topk_int8"``, ...), whose stages then
            count exchanges. Without ``optimizer``, call ``state.after_optimizer_step()`` after every
            ``optimizer.step()``; a missed or doubled call raises at the next forward pass (run all
            but the last backward pass of an accumulated step under ``model.no_sync()``).
        outer, outer_lr, outer_momentum: with ``delay``, how the averaged update moves the
            synchronized weights: ``"average"`` (default, SBC) or ``"sgd"`` (DiLoCo's outer SGD with
            Nesterov momentum on the pseudo-gradient; lr 0.7 and momentum 0.9 unless given).
        fragments: with ``delay``, Streaming DiLoCo's fragments of the parameters, exchanged on
            staggered steps (default 1: all at once).
        fragment_split: with ``fragments``, how they are balanced: ``"strided"`` (default,
            the paper's) or ``"contiguous"`` (:func:`lgc.ddp.fragments.split_into_fragments`).
        overlap_steps: with ``delay``, Streaming DiLoCo's overlap ``tau``: each exchange starts
            ``tau`` local steps before its turn and runs while they compute (default 0: it blocks);
            below ``delay / fragments`` (:mod:`lgc.ddp.streaming`). Call ``state.flush()`` after the
            last step to apply an exchange still in flight.
        mixing: with ``delay``, the local weights' share ``alpha`` when an exchange is applied:
            ``lerp(synchronized, local, alpha)`` (default 0, torchft's: the synchronized weights).
        min_numel: parameters with fewer elements go dense. ``None`` (default): the method's own,
            part of its definition (:attr:`~lgc.compressors.Compressor.default_min_numel`): 1 (every
            parameter) for the methods defined on every tensor (DeMo, SparseLoCo, chunked top-k,
            fp4), 1,024 for the others (biases and norm layers dense; ``docs/methods.md`` lists
            where that departs from a reference's code).
        start_iter: plain-allreduce iterations before compressing (lgc compressors only; default: the
            method's own, 0 for DeMo as its reference, 1 otherwise).
        overlap: encode and send every bucket as soon as DDP hands it over, overlapping the
            collectives with the rest of the backward pass (default ``False``: held until the
            step's last bucket). Bitwise the same training; costs a second fp32 residual per
            compressed parameter (DGC: a second momentum and accumulator). Error feedback over a
            compressor without state of its own whose payloads are gathered (top-k, SBC,
            EF-signSGD, chunked top-k, DeMo), DGC, QSGD, TernGrad, RedSync and random-block with
            unshared offsets, which hold their own state back too; LGC, the shared-index codecs
            and summed payloads refuse it (:class:`~lgc.ddp.CompressionHookState`).
        pack: put each compressed step on the wire in two collectives whatever the number of
            buckets (flags, sizes, dense tensors and buffers in one allreduce, the payloads in one
            more; :mod:`lgc.ddp.packed`). ``None`` (default): wherever the method allows it (every
            lgc compressor with state, unless ``overlap``); ``True``: required; ``False``: bucket by
            bucket.
        buffers: module buffers (BatchNorm's running statistics) every step: ``"broadcast"``
            (rank 0's on every rank, as DDP keeps them; the default) or ``"average"`` (the
            floating-point ones averaged over the workers, for shards that differ in
            distribution); counted either way. Not with ``delay``, which averages them at every
            exchange (:mod:`lgc.ddp.buffers`). An FSDP2 model keeps each rank's own buffers, as
            FSDP2 does, unless ``buffers`` is given: then they are kept in step once per step, at the
            end of the backward pass.
        process_group: the group to communicate in (default: the world).
        replicate: FSDP2 only, hybrid sharding: the replicate dimension of a 2-D mesh
            (``mesh["replicate"]``, or its process group) when the model is sharded over the other
            (``fully_shard(module, mesh=mesh["shard"])``). FSDP2's reduce-scatter inside a replica
            stays exact; the all-reduce across replicas is compressed, each rank coding its shards
            (:mod:`lgc.fsdp.reduce_scatter`).
        optimizer_momentum / optimizer_weight_decay: what the optimizer will apply, for DGC when the
            optimizer is not built yet (one or the other: ``optimizer`` is checked directly).
        grad_scaler: AMP's ``GradScaler`` when training with fp16 loss scaling: compressors with state then
            see unscaled gradients (residuals and momenta must not mix scales), stateless ones the scaled
            gradients, as PyTorch's hooks do (see
            :meth:`lgc.ddp.CompressionHookState.unscale`). Refused for PyTorch's own hooks, which
            cannot be unscaled, and for communication delay, whose exchanges carry weight updates.
        **knobs: the method's own keyword arguments, overriding its defaults, e.g. ``density=0.001``
            (dict knobs such as LGC's ``autoencoder`` are merged key by key).

    Returns:
        The hook state: ``state.stats`` counts bytes (``compression_ratio``); save
        ``state.state_dict()`` with every rank's checkpoint (residuals differ between ranks). DGC's
        density warm-up is per epoch: pass ``steps_per_epoch=len(train_loader)`` (it then follows
        the optimizer steps) or call ``state.set_epoch(epoch)`` at the start of every epoch; with
        neither, the first compressed step refuses to run it.

    Raises:
        TypeError: ``model`` is not DDP, or an unknown knob.
        RuntimeError: no process group.
        ValueError: a combination the method would run wrongly (the message says what to change).

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = lgc.compress(model, "topk", optimizer=opt, density=0.01)  # with error feedback
        >>> state = lgc.compress(model, "dgc", optimizer=opt, steps_per_epoch=len(loader))  # opt: momentum=0
        >>> state = lgc.compress(model, "lgc_rar", stages={"warmup_steps": 100, "ae_steps": 300})
        >>> state = lgc.compress(model, "sbc", optimizer=opt, delay=4)  # 4 local steps per exchange
        >>> state = lgc.compress(model, "none", optimizer=opt, delay=50, outer="sgd")  # DiLoCo, H = 50
    """
    model = _uncompiled(model)
    _check_model(model, process_group)
    replicate_group = replicate_group_of(model, replicate)
    _check_optimizer(model, optimizer, optimizer_momentum, optimizer_weight_decay)
    sharded = isinstance(model, FSDPModule)
    comm_settings = dict(
        min_numel=min_numel,
        start_iter=start_iter,
        overlap=overlap,
        pack=pack,
        buffers=buffers,
        delay=delay,
        outer=outer,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        fragments=fragments,
        fragment_split=fragment_split,
        overlap_steps=overlap_steps,
        mixing=mixing,
    )
    if isinstance(method, HookState):
        # Only error_feedback=False may come with a ready state: it says a bare sparsifier inside is meant.
        settings = dict(
            **comm_settings,
            error_decay=error_decay,
            process_group=process_group,
            **knobs,
            error_feedback=error_feedback or None,
        )
        given = sorted(name for name, value in settings.items() if value is not None)
        if given:
            raise ValueError(
                f"{type(method).__name__} is a hook state, which carries its own configuration; "
                f"{', '.join(given)} cannot change it: pass the compressor or the method's name instead, "
                "or build the state with those settings"
            )
        state = method
    else:
        if sharded:
            check_fsdp_settings(comm_settings)
        state = _build(method, knobs, Comm(**comm_settings, prefix=""), error_feedback, error_decay, process_group)
    if sharded:
        check_sharded(state, method, replicate_group is not None)
    check_error_feedback(state, method, error_feedback)
    _check_against_optimizer(state, optimizer, optimizer_momentum, optimizer_weight_decay)
    if grad_scaler is not None:
        if not state.unscales_gradients:
            raise ValueError(
                "grad_scaler= unscales the gradients an lgc compressor with state sees; "
                f"{type(state).__name__} does not take it (PyTorch's hooks compress scaled gradients; "
                "communication delay exchanges weight updates)"
            )
        state.loss_scale = grad_scaler.get_scale
    if sharded:
        register_sharded(state, model, replicate_group, buffers, optimizer)
    else:
        state.register(model, optimizer)
    return state


def _uncompiled(model: Any) -> Any:
    """The module ``torch.compile`` wrapped (its hooks are the wrapped DDP model's), else ``model``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model


def _check_model(model: Any, process_group: dist.ProcessGroup | None) -> None:
    if isinstance(model, FSDPModule):
        if process_group is not None:
            raise ValueError(
                "process_group= does not apply to an FSDP2 model: its mesh (fully_shard(mesh=...)) decides"
            )
        return
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"lgc.compress needs a DistributedDataParallel model or an FSDP2 one (fully_shard), got "
            f"{type(model).__name__}: wrap it first, in every worker after torch.distributed.init_process_group(...): "
            "model = DistributedDataParallel(model), or fully_shard(model)"
        )
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "lgc.compress needs an initialized process group: call torch.distributed.init_process_group(...) in "
            "every worker (torchrun sets rank and world size) before DistributedDataParallel(model)"
        )


def _check_optimizer(
    model: DistributedDataParallel,
    optimizer: Any,
    optimizer_momentum: float | None,
    optimizer_weight_decay: float | None,
) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if optimizer_momentum is not None or optimizer_weight_decay is not None:
        raise ValueError(
            "pass either optimizer= (its momentum and weight decay are read from it) or "
            "optimizer_momentum= / optimizer_weight_decay= (for an optimizer built later), not both"
        )
    params = {id(p) for p in model.parameters()}
    if not any(id(p) in params for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("optimizer holds none of the model's parameters: pass the optimizer that steps this model")


def check_sharded_method(method: str, *, hybrid: bool, **kwargs: Any) -> None:
    """What :func:`compress` refuses for ``method`` on an FSDP2 model, checked without the model or a process group,
    so that a launcher can refuse before any worker starts (``lgc-bench step --fsdp``/``--hsdp``).

    ``hybrid``: the model is hybrid-sharded (``replicate=`` will be given). ``kwargs``: what ``compress`` would be
    given besides the model, the optimizer and the groups: its settings (``delay``, ``min_numel``, ...,
    ``error_feedback``) and the method's knobs. Raises the ValueError or TypeError ``compress`` raises.
    """
    comm_keys = [field.name for field in dataclasses.fields(Comm) if field.name != "prefix"]
    comm = {key: kwargs.pop(key, None) for key in comm_keys}
    error_feedback, error_decay = kwargs.pop("error_feedback", None), kwargs.pop("error_decay", None)
    check_fsdp_settings(comm)
    state = _build(method, kwargs, Comm(**comm, prefix=""), error_feedback, error_decay, None)
    check_sharded(state, method, hybrid)


def _build(
    method: str | Compressor,
    knobs: dict[str, Any],
    comm: Comm,
    error_feedback: bool | None,
    error_decay: float | None,
    process_group: dist.ProcessGroup | None,
) -> HookState:
    """The hook state for a method's name or a compressor (not yet registered)."""
    settings = dict(error_feedback=error_feedback, error_decay=error_decay, process_group=process_group, prefix="")
    if isinstance(method, str):
        try:
            entry = METHODS[method]
        except KeyError as err:
            raise ValueError(err.args[0]) from None
        unknown = sorted(set(knobs) - set(entry.knobs))
        if unknown:
            raise TypeError(
                f"{method!r} ({entry.cls.__name__}) has no knob {', '.join(map(repr, unknown))}; "
                f"its knobs: {', '.join(entry.knobs)}"
            )
        return build_hook_state(entry.resolve(**knobs), comm, name=method, **settings)
    if isinstance(method, Compressor):
        if knobs:
            raise TypeError(
                f"knobs ({', '.join(sorted(knobs))}) configure a method given by name; "
                f"{type(method).__name__} is built already: pass them to its constructor"
            )
        return build_hook_state(method, comm, **settings)
    raise TypeError(
        f"method must be a name ({', '.join(sorted(METHODS))}), an lgc Compressor or a hook state, "
        f"got {type(method).__name__}"
    )


def _optimizer_setting(optimizer: torch.optim.Optimizer, setting: str) -> tuple[float, str]:
    """The largest value of a hyperparameter over the optimizer's param groups, and where it was found."""
    found = (0.0, "")
    for index, group in enumerate(optimizer.param_groups):
        key = setting
        if setting == "momentum" and "momentum" not in group and "betas" in group:
            key = "betas"  # Adam's first moment is a momentum
        value = group.get(key, 0.0)
        value = float(value[0] if key == "betas" else value or 0.0)
        if abs(value) > abs(found[0]):
            found = (value, f"{type(optimizer).__name__} param_groups[{index}][{key!r}]")
    return found


def _check_against_optimizer(
    state: HookState,
    optimizer: torch.optim.Optimizer | None,
    optimizer_momentum: float | None,
    optimizer_weight_decay: float | None,
) -> None:
    """The method's optimizer rules (DGC's, DeMo's) on what the optimizer applies, named where it comes from.

    Without an optimizer, the declared ``optimizer_momentum`` / ``optimizer_weight_decay`` stand for
    one built later; a method that must know them (DGC) is refused when they are not declared.
    """
    if optimizer is not None:
        momentum, momentum_source = _optimizer_setting(optimizer, "momentum")
        decay, decay_source = _optimizer_setting(optimizer, "weight_decay")
        state.check_optimizer(momentum, decay, sources=(momentum_source, decay_source))
        return
    declared = {"momentum": optimizer_momentum, "weight_decay": optimizer_weight_decay}
    missing = [name for name in state.optimizer_settings_needed() if declared[name] is None]
    if missing:
        needed = ", ".join(f"optimizer_{name}=0" for name in missing)
        applied = " and ".join(n.replace("_", " ") for n in missing)
        raise ValueError(
            f"{optimizer_rules_owner(state)} applies {applied} itself, so it must "
            f"know what the optimizer applies: pass optimizer=your_optimizer, or declare {needed} for an optimizer "
            "built later"
        )
    if optimizer_momentum is not None:
        state.check_optimizer(
            float(optimizer_momentum),
            None if optimizer_weight_decay is None else float(optimizer_weight_decay),
            sources=("optimizer_momentum", "optimizer_weight_decay"),
        )
