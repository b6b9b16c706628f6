"""``lgc.compress``: the one way to put any lgc method on a DistributedDataParallel model.

Every method of ``lgc/conf/compressor/`` is available by name with its paper's defaults, or by
object (a :class:`~lgc.compressors.Compressor`, or a hook state built by hand). The call checks what
a plain DDP script gets wrong silently and refuses it with a message that says what to change:

* a model that is not :class:`~torch.nn.parallel.DistributedDataParallel`, or no process group;
* a sparsifier (top-k, SBC, RedSync, random block) or EF-signSGD without error feedback: what it
  does not send would be dropped, not delayed; ``error_feedback=False`` says that is meant;
* :class:`~lgc.compressors.ErrorFeedback` around DGC, which keeps its own;
* DGC next to an optimizer that applies momentum, or weight decay that DGC applies as well
  (:func:`lgc.compressors.dgc.check_optimizer_momentum`'s rules), and DGC's per-epoch warm-up
  with neither ``steps_per_epoch`` nor ``state.set_epoch`` to advance it (refused at its first
  compressed step, where it is known that nothing called ``set_epoch``);
* communication delay whose ``after_optimizer_step()`` is forgotten (workers would drift apart
  without ever exchanging) or called twice per step.

The registry :data:`METHODS` holds, for every name, the class, its yaml's values and whether the
yaml wraps it in error feedback; ``tests/test_api.py`` keeps it equal to the yamls, so the Hydra
command ``lgc-train compressor=NAME`` and ``lgc.compress(model, NAME)`` build the same thing
without the core importing Hydra.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import difflib
import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors import (
    ChunkedTopKCompressor,
    Compressor,
    DGCCompressor,
    ErrorFeedback,
    FP4Compressor,
    FP16Compressor,
    NoneCompressor,
    QSGDCompressor,
    QuantizedValues,
    RandomBlockCompressor,
    RedSyncCompressor,
    SBCCompressor,
    SignSGDCompressor,
    TernGradCompressor,
    TopKCompressor,
)
from lgc.compressors.base import compressor_chain
from lgc.compressors.demo import DeMoCompressor, check_demo_optimizer
from lgc.compressors.dgc import PAPER_WARMUP_DENSITIES, check_optimizer_momentum
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.lgc_ps import LGCParameterServerState
from lgc.ddp.lgc_rar import LGCRingAllreduceState
from lgc.ddp.local_sgd import FRAGMENT_SPLITS, CommunicationDelayState, local_step_hook
from lgc.ddp.shared_index import SharedIndexState
from lgc.ddp.torch_hooks import PowerSGDHookState, TorchHookState

__all__ = ["METHODS", "HookState", "Method", "compress"]

#: What :func:`compress` returns: the state of the hook it registered.
HookState = CompressionHookState | CommunicationDelayState | TorchHookState


class Method(NamedTuple):
    """One entry of :data:`METHODS`: what ``compress(model, name)`` builds."""

    #: The compressor or hook-state class (the yaml's ``_target_``).
    cls: type
    #: The yaml's values of its knobs (the paper's defaults); keyword arguments of ``compress`` override them.
    defaults: Mapping[str, Any]
    #: The yaml's ``error_feedback``: wrap the compressor in :class:`~lgc.compressors.ErrorFeedback`.
    error_feedback: bool = False
    #: The yaml's ``error_decay``: error feedback's residual decay (SparseLoCo 0.95, DeMo 0.999; 1 keeps all).
    error_decay: float = 1.0


_POWERSGD = dict(
    matrix_approximation_rank=1,
    start_powerSGD_iter=10,
    min_compression_rate=2,
    use_error_feedback=True,
    warm_start=True,
    batched=False,
    random_seed=0,
    orthogonalization_epsilon=1e-8,
)
# The LGC yamls' values, shared by both topologies. min_numel is compress()'s own argument and
# world_size comes from the process group at registration.
_LGC = dict(
    density=0.01,
    warmup_steps=30,
    warmup="dense",
    warmup_densities=list(PAPER_WARMUP_DENSITIES),
    ae_steps=60,
    ae_updates_per_step=4,
    refresh_threshold=None,
    refresh_patience=5,
    refresh_steps=None,
    autoencoder=dict(
        chunk=64,
        encoder_channels=[64, 128, 256, 64],
        latent_channels=4,
        decoder_channels=[32, 64, 128, 32],
        decoder="transposed",
        seed=0,
        init=None,
    ),
    ae_optimizer="adam",
    ae_lr=1e-3,
    ae_batch_size=64,
    ae_buffer_size=4096,
    leader_rank=0,
    rotate_leader=False,
    index_coding="raw",
    value_order="value",
    latent_dtype="float32",
    measure_error=False,
)
_LGC_RAR = dict(
    _LGC,
    rotate_leader=True,
    loss_weights=dict(reconstruction=0.5, similarity=0.5, mean=1.0),
    residual="own_reconstruction",
)
# shared_topk.yaml: LGC's stages and leader without the autoencoder.
_SHARED = dict(
    density=0.01,
    warmup_steps=30,
    warmup="dense",
    warmup_densities=list(PAPER_WARMUP_DENSITIES),
    ae_steps=0,
    values="float32",
    leader_only=False,
    chunk=64,
    seed=0,
    leader_rank=0,
    rotate_leader=True,
    index_coding="raw",
    value_order="position",
    measure_error=False,
)
_LGC_PS = dict(_LGC, innovation_density=0.001, loss_weights=dict(reconstruction=0.5, similarity=0.5))
# lgc_*_paper.yaml: the LGC paper's scale (CIFAR-10 ResNets on 8 GPUs).
_LGC_PAPER = dict(density=0.001, warmup_steps=975, ae_steps=300, ae_updates_per_step=1)


def _paper(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**base, **_LGC_PAPER, "autoencoder": {**base["autoencoder"], "chunk": 256}, **changes}


#: Every method of ``lgc/conf/compressor/``, by the yaml's name (``lgc-train compressor=NAME``).
METHODS: Mapping[str, Method] = MappingProxyType(
    {
        "none": Method(NoneCompressor, {}),
        "fp16": Method(FP16Compressor, dict(dtype="float16")),
        "fp4": Method(FP4Compressor, dict(bucket_size=256)),
        "topk": Method(TopKCompressor, dict(density=0.01, value_dtype="float32"), error_feedback=True),
        "dgc": Method(
            DGCCompressor,
            dict(
                density=0.001,
                momentum=0.9,
                nesterov=False,
                momentum_masking=True,
                clip_norm=None,
                # The yaml takes the run's regularization.weight_decay, else this, the paper's value.
                weight_decay=5e-4,
                warmup_densities=list(PAPER_WARMUP_DENSITIES),
                # The run's length: a plain script passes steps_per_epoch= (or calls state.set_epoch).
                steps_per_epoch=None,
                sample_fraction=0.01,
                exact_below_numel=131072,
                seed=0,
            ),
        ),
        "sbc": Method(SBCCompressor, dict(density=0.01, golomb_parameter=None), error_feedback=True),
        "redsync": Method(
            RedSyncCompressor,
            dict(density=0.001, method="trimmed_topk", reuse_threshold=False, epsilon=1e-5, quantize=False),
            error_feedback=True,
        ),
        "random_block": Method(RandomBlockCompressor, dict(density=0.01, shared=True, seed=0), error_feedback=True),
        "qsgd": Method(QSGDCompressor, dict(levels=4, bucket_size=512, seed=0)),
        "terngrad": Method(TernGradCompressor, dict(bucket_size=None, clip_sigma=2.5, seed=0)),
        "signsgd": Method(SignSGDCompressor, {}, error_feedback=True),
        "torch_fp16": Method(TorchHookState, dict(hook="fp16")),
        "torch_bf16": Method(TorchHookState, dict(hook="bf16")),
        "powersgd": Method(PowerSGDHookState, _POWERSGD),
        "batched_powersgd": Method(PowerSGDHookState, dict(_POWERSGD, batched=True)),
        "lgc_rar": Method(LGCRingAllreduceState, _LGC_RAR),
        "lgc_ps": Method(LGCParameterServerState, _LGC_PS),
        "lgc_rar_paper": Method(LGCRingAllreduceState, _paper(_LGC_RAR)),
        "lgc_rar_linear": Method(LGCRingAllreduceState, dict(_LGC_RAR, codec="linear", linear_latent=None)),
        "shared_topk": Method(SharedIndexState, _SHARED),
        "shared_topk_int8": Method(
            SharedIndexState, dict(_SHARED, values="int8", warmup_steps=1, index_coding="golomb")
        ),
        "leader_scaled": Method(SharedIndexState, dict(_SHARED, leader_only=True)),
        "chunked_topk": Method(
            ChunkedTopKCompressor,
            dict(chunk=64, k=64, tiling="shape", aggregate="sender_mean", value_dtype="float32"),
            error_feedback=True,
        ),
        "demo": Method(
            DeMoCompressor,
            dict(chunk=64, k=32, sign=True, tiling="shape", aggregate="sender_mean", value_dtype="float32"),
            error_feedback=True,
            error_decay=0.999,
        ),
        "sparseloco": Method(
            QuantizedValues,
            dict(
                sparsifier={
                    "_target_": "lgc.compressors.ChunkedTopKCompressor",
                    "chunk": 64,
                    "k": 64,
                    "tiling": "shape",
                    "aggregate": "sender_mean",
                    "value_dtype": "float32",
                },
                bits=2,
                range_sigmas=6.0,
            ),
            error_feedback=True,
            error_decay=0.95,
        ),
        "lgc_ps_paper": Method(LGCParameterServerState, _paper(_LGC_PS, innovation_density=1e-5)),
    }
)

#: Compressors that drop what they do not send unless error feedback keeps it (the yamls' ``error_feedback: true``).
_NEEDS_ERROR_FEEDBACK = tuple({m.cls for m in METHODS.values() if m.error_feedback})


def compress(
    model: DistributedDataParallel,
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
    min_numel: int | None = None,
    start_iter: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    optimizer_momentum: float | None = None,
    optimizer_weight_decay: float | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    **knobs: Any,
) -> HookState:
    """Make ``model`` communicate through ``method``: register the hook and return its state.

    Call it in every worker, after ``dist.init_process_group`` and ``DistributedDataParallel(...)``,
    before the first backward pass; then train as usual.

    Args:
        model: the :class:`~torch.nn.parallel.DistributedDataParallel` model.
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
            exchange their weight updates through the compressor (:mod:`lgc.ddp.local_sgd`).
            Without ``optimizer``, call ``state.after_optimizer_step()`` after every
            ``optimizer.step()``; a missed or doubled call raises at the next forward pass (run all
            but the last backward pass of an accumulated step under ``model.no_sync()``).
        outer, outer_lr, outer_momentum: with ``delay``, how the averaged update moves the
            synchronized weights: ``"average"`` (default, SBC) or ``"sgd"`` (DiLoCo's outer SGD with
            Nesterov momentum on the pseudo-gradient; lr 0.7 and momentum 0.9 unless given).
        fragments: with ``delay``, Streaming DiLoCo's fragments of the parameters, exchanged on
            staggered steps (default 1: all at once).
        fragment_split: with ``fragments``, how they are balanced: ``"strided"`` (default,
            the paper's) or ``"contiguous"`` (:func:`lgc.ddp.local_sgd.split_into_fragments`).
        min_numel: parameters with fewer elements go dense. ``None`` (default): the method's own,
            part of its definition (:attr:`~lgc.compressors.Compressor.default_min_numel`): 1 (every
            parameter) for the methods whose reference sends every tensor, 1,024 for the others
            (biases and norm layers dense).
        start_iter: plain-allreduce iterations before compressing (lgc compressors only; default 1).
        process_group: the group to communicate in (default: the world).
        optimizer_momentum / optimizer_weight_decay: what the optimizer will apply, for DGC when the
            optimizer is not built yet (one or the other: ``optimizer`` is checked directly).
        grad_scaler: AMP's ``GradScaler`` when training with fp16 loss scaling: compressors then see
            unscaled gradients (residuals and momenta must not mix scales; see
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
        >>> state = lgc.compress(model, "lgc_rar", warmup_steps=100, ae_steps=300)
        >>> state = lgc.compress(model, "sbc", optimizer=opt, delay=4)  # 4 local steps per exchange
        >>> state = lgc.compress(model, "none", optimizer=opt, delay=50, outer="sgd")  # DiLoCo, H = 50
    """
    _check_model(model, process_group)
    _check_optimizer(model, optimizer, optimizer_momentum, optimizer_weight_decay)
    if delay is None and (
        outer is not None
        or outer_lr is not None
        or outer_momentum is not None
        or fragments is not None
        or fragment_split is not None
    ):
        raise ValueError(
            f"outer={outer!r}, outer_lr={outer_lr!r}, outer_momentum={outer_momentum!r}, fragments={fragments!r} "
            f"and fragment_split={fragment_split!r} act on the exchanges of local steps: they need delay="
        )
    config = dict(
        error_feedback=error_feedback,
        error_decay=error_decay,
        delay=delay,
        outer=outer,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        fragments=fragments,
        fragment_split=fragment_split,
        min_numel=min_numel,
        start_iter=start_iter,
        process_group=process_group,
    )
    if isinstance(method, HookState):
        # Only error_feedback=False may come with a ready state: it says a bare sparsifier inside is meant.
        settings = {**config, **knobs, "error_feedback": error_feedback or None}
        given = sorted(name for name, value in settings.items() if value is not None)
        if given:
            raise ValueError(
                f"{type(method).__name__} is a hook state, which carries its own configuration; "
                f"{', '.join(given)} cannot change it: pass the compressor or the method's name instead, "
                "or build the state with those settings"
            )
        state = method
    else:
        state = _build(method, knobs, **config)
    _check_error_feedback(state, method, error_feedback)
    _check_dgc(state, optimizer, optimizer_momentum, optimizer_weight_decay)
    if optimizer is not None or optimizer_momentum is not None:
        momentum = _optimizer_setting(optimizer, "momentum")[0] if optimizer is not None else optimizer_momentum
        check_demo_optimizer(state, momentum)
    if grad_scaler is not None:
        if not isinstance(state, CompressionHookState) or isinstance(state, CommunicationDelayState):
            raise ValueError(
                f"grad_scaler= unscales the gradients an lgc compressor sees; {type(state).__name__} does not take "
                "it (PyTorch's hooks compress scaled gradients; communication delay exchanges weight updates)"
            )
        state.loss_scale = grad_scaler.get_scale
    if isinstance(state, CommunicationDelayState):
        _register_delay(model, state, optimizer)
    else:
        if process_group is not None and isinstance(state, TorchHookState):
            state.process_group = process_group
        state.register(model)
    return state


def _check_model(model: Any, process_group: dist.ProcessGroup | None) -> None:
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"lgc.compress needs a DistributedDataParallel model, got {type(model).__name__}: wrap it first, in "
            "every worker after torch.distributed.init_process_group(...): model = DistributedDataParallel(model)"
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


def _resolve(name: str) -> Method:
    method = METHODS.get(name)
    if method is None:
        close = difflib.get_close_matches(name, METHODS, n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"unknown method {name!r}{hint}; the methods are {', '.join(sorted(METHODS))}")
    return method


def _knobs_of(cls: type) -> list[str]:
    """The keyword arguments of ``cls``'s constructor, through ``**kwargs`` to its base classes."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    # compress() takes these itself; a hook state's compressor is the method.
    return [name for name in dict.fromkeys(names) if name not in ("min_numel", "process_group", "compressor")]


def _build(
    method: str | Compressor,
    knobs: dict[str, Any],
    *,
    error_feedback: bool | None,
    error_decay: float | None = None,
    delay: int | None,
    min_numel: int | None,
    start_iter: int | None,
    process_group: dist.ProcessGroup | None,
    outer: str | None = None,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    fragments: int | None = None,
    fragment_split: str | None = None,
) -> HookState:
    """The hook state for a method's name or a compressor (not yet registered)."""
    if isinstance(method, str):
        entry = _resolve(method)
        what = f"{method!r} ({entry.cls.__name__})"
        allowed = _knobs_of(entry.cls)
        unknown = sorted(set(knobs) - set(allowed))
        if unknown:
            raise TypeError(f"{what} has no knob {', '.join(map(repr, unknown))}; its knobs: {', '.join(allowed)}")
        kwargs = {**entry.defaults}
        for name, value in knobs.items():
            default = kwargs.get(name)
            # Dict knobs (LGC's autoencoder, loss_weights) change the keys given, the rest stay the yaml's.
            kwargs[name] = {**default, **value} if isinstance(default, dict) and isinstance(value, Mapping) else value
        if not issubclass(entry.cls, Compressor):
            _refuse_compressor_settings(what, error_feedback or error_decay is not None, delay, start_iter)
            if issubclass(entry.cls, TorchHookState):
                if min_numel is not None:
                    raise ValueError(f"min_numel does not apply to {what}: PyTorch's hook compresses every parameter")
                return entry.cls(**kwargs)
            return entry.cls(**kwargs, min_numel=min_numel, process_group=process_group)
        compressor: Compressor = entry.cls(**kwargs)
        wrap = entry.error_feedback if error_feedback is None else error_feedback
    elif isinstance(method, Compressor):
        if knobs:
            raise TypeError(
                f"knobs ({', '.join(sorted(knobs))}) configure a method given by name; "
                f"{type(method).__name__} is built already: pass them to its constructor"
            )
        if error_feedback is False and isinstance(method, ErrorFeedback):
            raise ValueError("error_feedback=False, but the compressor is wrapped in ErrorFeedback")
        compressor, wrap = method, bool(error_feedback) and not isinstance(method, ErrorFeedback)
    else:
        raise TypeError(
            f"method must be a name ({', '.join(sorted(METHODS))}), an lgc Compressor or a hook state, "
            f"got {type(method).__name__}"
        )
    if wrap:
        _check_own_error_feedback(compressor)
        default_decay = entry.error_decay if isinstance(method, str) else 1.0
        compressor = ErrorFeedback(compressor, decay=_or(error_decay, default_decay))
    elif error_decay is not None:
        raise ValueError(
            f"error_decay={error_decay!r} is the decay of error feedback's residual, but {compressor!r} runs without "
            "error feedback: pass error_feedback=True, or a method whose yaml has it"
        )
    if delay is not None:
        if start_iter is not None:
            raise ValueError(f"start_iter does not apply with delay={delay!r}: the local steps start at once")
        return CommunicationDelayState(
            compressor,
            delay=delay,
            min_numel=min_numel,
            process_group=process_group,
            outer=_or(outer, "average"),
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            fragments=_or(fragments, 1),
            fragment_split=_or(fragment_split, FRAGMENT_SPLITS[0]),
        )
    return CompressionHookState(
        compressor, min_numel=min_numel, start_iter=_or(start_iter, 1), process_group=process_group
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _refuse_compressor_settings(what: str, error_feedback: bool | None, delay: Any, start_iter: Any) -> None:
    """LGC and PyTorch's hooks are hook states of their own, with their own residuals and warm-up."""
    if error_feedback:
        raise ValueError(f"error_feedback does not apply to {what}, which keeps its own residuals")
    if delay is not None:
        raise ValueError(f"delay={delay!r} needs an lgc compressor (e.g. 'sbc', 'topk'), not {what}")
    if start_iter is not None:
        raise ValueError(
            f"start_iter does not apply to {what}: its own knob sets the dense warm-up "
            "(LGC: warmup_steps; PowerSGD: start_powerSGD_iter)"
        )


def _check_own_error_feedback(compressor: Any) -> None:
    chain = compressor_chain(compressor)
    if any(isinstance(c, DGCCompressor) for c in chain):
        raise ValueError(
            "DGC keeps its own error feedback (its accumulator holds what was not sent); ErrorFeedback around it "
            "would feed the error back twice: pass DGCCompressor(...) itself, or 'dgc' without error_feedback=True"
        )


def _check_error_feedback(state: Any, method: Any, error_feedback: bool | None) -> None:
    chain = compressor_chain(state)
    if any(isinstance(c, ErrorFeedback) for c in chain):
        _check_own_error_feedback(state)
        return
    core = chain[-1]
    if not isinstance(core, _NEEDS_ERROR_FEEDBACK) or error_feedback is False:
        return
    name = type(core).__name__
    density = getattr(core, "density", None)
    if density is not None:
        loses = (
            f"it sends {density:.3g} of each gradient, and without error feedback the other {1 - density:.3g} is "
            "dropped at every step (lost, not delayed), so training follows a shrunken, biased gradient"
        )
    else:
        loses = (
            "its scaled sign is biased, and without error feedback the difference is dropped at every step "
            "(EF-signSGD converges because error feedback sends it later)"
        )
    fix = (
        f"wrap it: ErrorFeedback({name}(...)), or pass error_feedback=True"
        if isinstance(method, Compressor)
        else "build the state around ErrorFeedback(...)"
    )
    raise ValueError(f"{name} without error feedback: {loses}; {fix}; error_feedback=False runs it without, as asked")


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


def _check_dgc(
    state: Any,
    optimizer: torch.optim.Optimizer | None,
    optimizer_momentum: float | None,
    optimizer_weight_decay: float | None,
) -> None:
    """DGC owns the momentum (and, with its weight_decay, the decay): the optimizer must not apply them again."""
    dgc = next((c for c in compressor_chain(state) if isinstance(c, DGCCompressor)), None)
    if dgc is None:
        return
    if optimizer is not None:
        momentum, momentum_source = _optimizer_setting(optimizer, "momentum")
        decay, decay_source = _optimizer_setting(optimizer, "weight_decay")
    elif optimizer_momentum is None or (dgc.weight_decay > 0 and optimizer_weight_decay is None):
        needed = "optimizer_momentum=0" + (", optimizer_weight_decay=0" if dgc.weight_decay > 0 else "")
        raise ValueError(
            "DGC applies momentum (and weight decay) itself, so it must know what the optimizer applies: pass "
            f"optimizer=your_optimizer, or declare {needed} for an optimizer built later"
        )
    else:
        momentum, momentum_source = float(optimizer_momentum), "optimizer_momentum"
        decay, decay_source = float(optimizer_weight_decay or 0.0), "optimizer_weight_decay"
    if momentum != 0.0:
        raise ValueError(
            f"DGC applies momentum itself (momentum correction, DGC's momentum={dgc.momentum}), but the optimizer "
            f"applies momentum too ({momentum_source}={momentum:g}), so it would be applied twice: set momentum=0 "
            "(and nesterov=False) in the optimizer, e.g. torch.optim.SGD(params, lr, momentum=0), and give the "
            f"momentum to DGC: lgc.compress(model, 'dgc', momentum={momentum:g})"
        )
    if decay != 0.0 and dgc.weight_decay > 0:
        raise ValueError(
            f"weight decay in the optimizer ({decay_source}={decay:g}) and in DGC (weight_decay={dgc.weight_decay:g}) "
            "would be applied twice: set the optimizer's weight_decay=0 (DGC gives the decay a momentum of its own, "
            "as SGD(momentum, weight_decay) does), or pass weight_decay=0 to DGC to keep the decay in "
            "the optimizer, where it acts outside the momentum, (1 - momentum) times as strong"
        )
    # The rules' home (lgc.compressors.dgc); anything it adds applies here too.
    check_optimizer_momentum(state, momentum, weight_decay=decay)


class _LocalStepCheck:
    """Makes a forgotten or doubled ``after_optimizer_step()`` loud in communication-delay mode.

    Between two synchronized backward passes (those that reach the DDP hook) the optimizer steps
    once, so ``after_optimizer_step()`` must run exactly once: never, and the workers never
    exchange and drift apart; twice, and they exchange at the wrong steps. The count is checked
    at the next forward pass with gradients, before it uses the weights.
    """

    __slots__ = ("state", "automatic", "backward_passes", "checked_passes", "steps_at_backward")

    def __init__(self, state: CommunicationDelayState, automatic: bool) -> None:
        self.state = state
        #: Whether an optimizer step post-hook calls after_optimizer_step (compress(optimizer=...)).
        self.automatic = automatic
        #: Synchronized backward passes finished, and how many of them the forward check has seen.
        self.backward_passes = 0
        self.checked_passes = 0
        #: ``state.local_steps`` when the last backward pass finished.
        self.steps_at_backward = 0

    def backward_done(self) -> None:
        self.backward_passes += 1
        self.steps_at_backward = self.state.local_steps

    def before_forward(self, module: nn.Module, args: Any) -> None:
        if self.checked_passes == self.backward_passes or not torch.is_grad_enabled():
            return
        self.checked_passes = self.backward_passes
        calls = self.state.local_steps - self.steps_at_backward
        if calls == 1:
            return
        delay = self.state.delay
        if calls == 0:
            how = (
                "the optimizer's step post-hook did not run: optimizer.step() was skipped (a GradScaler skips it "
                "for an inf/NaN on this rank only); with a GradScaler, do not pass optimizer= and call "
                "state.after_optimizer_step() after every scaler.step(optimizer)"
                if self.automatic
                else "pass optimizer=your_optimizer to lgc.compress (it then calls after_optimizer_step after every "
                "optimizer.step()), or call state.after_optimizer_step() after every optimizer.step()"
            )
            raise RuntimeError(
                f"communication delay (delay={delay}): a backward pass finished but state.after_optimizer_step() "
                "was not called before this forward pass, so this local step is not counted and the workers would "
                f"drift apart without exchanging their updates: {how}. (Accumulating gradients over several "
                "backward passes per step? Run all but the last under model.no_sync().)"
            )
        fix = (
            "lgc.compress(..., optimizer=...) already calls it after every optimizer.step(): remove your own call"
            if self.automatic
            else "call it once per optimizer step"
        )
        raise RuntimeError(
            f"communication delay (delay={delay}): state.after_optimizer_step() ran {calls} times since the last "
            f"backward pass, so the workers would exchange at the wrong steps: {fix}"
        )


def _checked_local_step_hook(check: _LocalStepCheck, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`lgc.ddp.local_sgd.local_step_hook`, counting finished backward passes for the check."""
    future = local_step_hook(check.state, bucket)
    if bucket.is_last():
        check.backward_done()
    return future


class _RegisteringThrough:
    """``model`` as :meth:`CommunicationDelayState.register` sees it: its hook is registered with the check."""

    def __init__(self, model: DistributedDataParallel, check: _LocalStepCheck) -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_check", check)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Flags the state sets on the model (DDP's buffer broadcast, lgc.ddp.buffers) reach the model.
        setattr(self._model, name, value)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        if state is not self._check.state or hook is not local_step_hook:
            raise RuntimeError("lgc.compress expected CommunicationDelayState.register to register local_step_hook")
        self._model.register_comm_hook(self._check, _checked_local_step_hook)


def _register_delay(
    model: DistributedDataParallel, state: CommunicationDelayState, optimizer: torch.optim.Optimizer | None
) -> None:
    check = _LocalStepCheck(state, automatic=optimizer is not None)
    state.register(_RegisteringThrough(model, check))  # type: ignore[arg-type]
    model.register_forward_pre_hook(check.before_forward)
    if optimizer is not None:
        optimizer.register_step_post_hook(lambda *_: state.after_optimizer_step())
