"""Every method by name, and the one builder that turns a method into a hook state.

A *method* is a compressor config of ``lgc/conf/compressor/`` (``lgc-train compressor=NAME``,
``lgc.compress(model, NAME)``): its ``_target_`` class with the paper's values of its knobs, and
whether error feedback wraps it (``error_feedback``, ``error_decay``). The yamls are the one source
of these values: :data:`METHODS` reads them from the installed package, applying their
``defaults:`` lists as Hydra does, without importing Hydra.

:func:`build_hook_state` is the only place that wraps a compressor in error feedback and chooses
between every-step communication (:class:`~lgc.ddp.CompressionHookState`) and local steps with
exchanges of weight updates (:class:`~lgc.ddp.local_sgd.CommunicationDelayState`); ``lgc-train``
(from ``cfg.compressor`` and ``cfg.comm``), :func:`lgc.compress` and ``lgc-bench`` all build through
it, so a setting is refused, or means the same, wherever it is given. Names in its messages carry
the caller's prefix (``comm.delay`` for a config, ``delay`` for a keyword argument).

Why one module: the registry and the builder's refusals, each naming a setting, stay together
because every refusal depends on what the registry says a method is.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from lgc.comm import COMM_OPTIONS, Comm, DiLoCo, EveryStep, LocalSGD
from lgc.compressors import Compressor, ErrorFeedback
from lgc.ddp.buffers import check_buffer_mode
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.ddp.local_step_hook import local_step_exchange
from lgc.ddp.torch_hooks import TorchHookState
from lgc.validation import PositiveFraction, check

__all__ = [
    "METHODS",
    "Comm",
    "Method",
    "build_compressor",
    "build_hook_state",
    "compressor_chain",
    "instantiate",
    "merge_knobs",
]

#: The packaged compressor configs, one per method.
CONF = Path(__file__).parent / "conf" / "compressor"
#: Keys of a compressor node that configure the ErrorFeedback wrapper, not the compressor.
ERROR_FEEDBACK_KEYS = ("error_feedback", "error_decay")
#: The first line of a config that sets other groups too (DGC's and DeMo's optimizer settings).
_GLOBAL_PACKAGE = "# @package _global_"


@dataclasses.dataclass(frozen=True)
class Method:
    """One method of ``lgc/conf/compressor/``: its yaml, composed as ``lgc-train compressor=NAME`` does."""

    #: The yaml's name.
    name: str
    #: The compressor node (``_target_``, the knobs, ``error_feedback``/``error_decay``), unresolved:
    #: DGC's ``weight_decay`` follows the run's ``regularization.weight_decay``.
    node: DictConfig
    #: What a ``# @package _global_`` yaml sets besides the compressor (``optimizer: {momentum: 0}``).
    run_settings: Mapping[str, Any]

    @property
    def target(self) -> str:
        """The ``_target_``: the compressor or hook-state class, by its import path."""
        return str(self.node._target_)

    @property
    def cls(self) -> type:
        """The class the method builds (imported)."""
        return _locate(self.target)

    @property
    def error_feedback(self) -> bool:
        """Whether error feedback wraps the compressor (the yaml's ``error_feedback``)."""
        return bool(self.node.get("error_feedback", False))

    @property
    def error_decay(self) -> float:
        """Error feedback's residual decay (the yaml's ``error_decay``; 1 keeps everything)."""
        return float(self.node.get("error_decay", 1.0))

    @property
    def defaults(self) -> dict[str, Any]:
        """The knobs' values a script gets by name (run-dependent ones at their fallback)."""
        node = self.resolve()
        return {key: value for key, value in node.items() if key not in ("_target_", *ERROR_FEEDBACK_KEYS)}

    @property
    def knobs(self) -> list[str]:
        """The keyword arguments of the class's constructor (through ``**kwargs`` to its bases).

        Left out: what the caller gives (``min_numel``, ``process_group``) and a hook state's
        ``compressor``, which the method is.
        """
        names = _init_parameters(self.cls)
        return [name for name in names if name not in ("min_numel", "process_group", "compressor")]

    def resolve(self, **knobs: Any) -> dict[str, Any]:
        """The node as a plain dict (run-dependent knobs at their fallback), with ``knobs`` applied.

        A knob's value replaces the yaml's; a dict knob (LGC's ``stages``, ``training``) changes
        the keys it gives and keeps the rest, at any depth (:func:`merge_knobs`).
        """
        run = OmegaConf.create({"compressor": self.node})
        node: dict[str, Any] = OmegaConf.to_container(run, resolve=True)["compressor"]  # type: ignore[index]
        return merge_knobs(node, knobs)


def merge_knobs(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s knobs on top; where both hold a mapping (a group of knobs), merged key by key."""
    merged = dict(base)
    for key, value in over.items():
        below = merged.get(key)
        both = isinstance(below, Mapping) and isinstance(value, Mapping)
        merged[key] = merge_knobs(below, value) if both else value  # type: ignore[arg-type]
    return merged


def _init_parameters(cls: type) -> list[str]:
    """The keyword arguments of ``cls(...)``, through ``**kwargs`` to its bases' ``__init__``."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(names))


def _plain(node: Mapping[str, Any]) -> dict[str, Any]:
    """A config node as a plain dict (interpolations resolved)."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)  # type: ignore[return-value]


def _locate(path: str) -> Any:
    """The object at an import path ``package.module.Name``."""
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name, None) if module_name else None
    except ImportError as err:
        raise ValueError(f"_target_={path!r}: cannot import {module_name!r} ({err})") from None
    if found is None:
        raise ValueError(f"_target_={path!r} names nothing importable")
    return found


def _load(name: str, seen: tuple[str, ...] = ()) -> tuple[DictConfig, dict[str, Any]]:
    """A compressor yaml merged with its ``defaults:`` list (siblings in this folder, ``_self_`` last unless placed)."""
    path = CONF / f"{name}.yaml"
    if name in seen:
        raise ValueError(f"{path.name}: its defaults list includes itself through {' -> '.join(seen)}")
    text = path.read_text()
    raw = OmegaConf.create(text)
    defaults = list(raw.pop("defaults", []))
    if "_self_" not in defaults:
        defaults.append("_self_")
    merged = OmegaConf.create()
    for entry in defaults:
        if entry == "_self_":
            merged = OmegaConf.merge(merged, raw)
        elif isinstance(entry, str) and (CONF / f"{entry}.yaml").is_file():
            base, _ = _load(entry, (*seen, name))
            merged = OmegaConf.merge(merged, base)
        else:
            raise ValueError(f"{path.name}: defaults entry {entry!r} is not a compressor config in {CONF.name}/")
    run_settings: dict[str, Any] = {}
    if text.startswith(_GLOBAL_PACKAGE):
        run_settings = {k: v for k, v in OmegaConf.to_container(merged).items() if k != "compressor"}  # type: ignore[union-attr]
        merged = merged.compressor
    return merged, run_settings


@cache
def _method(name: str) -> Method:
    """One packaged yaml as a :class:`Method`, read on first use (once per process)."""
    node, run_settings = _load(name)
    return Method(name, node, run_settings)


@cache
def _names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in CONF.glob("*.yaml")))


class _Registry(Mapping[str, Method]):
    """The methods by name; each yaml is read when its method is first asked for."""

    def __getitem__(self, name: str) -> Method:
        names = _names()
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise KeyError(f"unknown method {name!r}{hint}; the methods are {', '.join(names)}")
        return _method(name)

    def __iter__(self) -> Iterator[str]:
        return iter(_names())

    def __len__(self) -> int:
        return len(_names())

    def __repr__(self) -> str:
        return f"METHODS({', '.join(self)})"


#: Every method of ``lgc/conf/compressor/`` by the yaml's name (``lgc-train compressor=NAME``).
METHODS: Mapping[str, Method] = _Registry()


_LOCAL_STEP_FIELDS = ("outer", "outer_lr", "outer_momentum", "fragments", "fragment_split", "overlap_steps", "mixing")


def instantiate(node: Mapping[str, Any], where: str = "") -> Any:
    """Build ``node``'s ``_target_`` with its other keys, nested ``_target_`` nodes first (Hydra's rule).

    Hydra's other special keys (``_partial_``, ``_args_``, ...) are refused by name. A constructor's
    own error keeps its type, its message prefixed with ``where`` (``compressor: ...``) if given.
    """
    special = sorted(key for key in node if key.startswith("_") and key != "_target_")
    if special:
        raise ValueError(f"{where or 'method'}: {', '.join(special)}: lgc builds a method from _target_ and knobs only")
    target = node.get("_target_")
    if not isinstance(target, str):
        raise ValueError(f"{where or 'method'}: a node needs a _target_ (an import path), got {target!r}")
    kwargs = {key: _instantiated(value, where) for key, value in node.items() if key != "_target_"}
    cls = _locate(target)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, FileNotFoundError) as err:
        if not where:
            raise
        raise type(err)(f"{where}: {err}") from err


def _instantiated(value: Any, where: str) -> Any:
    if isinstance(value, Mapping):
        if "_target_" in value:
            return instantiate(value, where)
        return {key: _instantiated(item, where) for key, item in value.items()}
    if isinstance(value, list):
        return [_instantiated(item, where) for item in value]
    return value


def _delayed(
    built: Compressor | CompressionHookState,
    comm: Comm,
    process_group: dist.ProcessGroup | None,
    min_numel: int | None = None,
) -> CommunicationDelayState:
    """``built`` exchanging the weight updates of ``comm.delay`` local steps.

    A compressor gets the hook state that exchanges them (from the first exchange: ``start_iter``
    0); an LGC-family state exchanges them itself.
    """
    assert comm.delay is not None
    if isinstance(built, Compressor):
        built = local_step_exchange(built, min_numel=min_numel, process_group=process_group)
    return CommunicationDelayState(
        built,
        delay=comm.delay,
        outer=comm.outer,
        outer_lr=comm.outer_lr,
        outer_momentum=comm.outer_momentum,
        fragments=comm.fragments,
        fragment_split=comm.fragment_split,
        overlap_steps=comm.overlap_steps,
        mixing=comm.mixing,
    )


def _is_hook_state(obj: Any) -> bool:
    """A method that is a hook state of its own (LGC, shared-index, PyTorch's hooks), not a compressor."""
    return not isinstance(obj, Compressor) and callable(getattr(obj, "register", None))


def _what(built: Any, name: str | None) -> str:
    return f"{name!r} ({type(built).__name__})" if name else built.describe()


def build_compressor(
    node: Mapping[str, Any] | Compressor,
    *,
    error_feedback: bool | None = None,
    error_decay: float | None = None,
    prefix: str = "compressor.",
    name: str | None = None,
) -> Any:
    """The compressor (error feedback wrapped around it where asked) or the hook state a node builds.

    Args:
        node: a compressor node (``_target_``, knobs, and ``error_feedback``/``error_decay``) or a
            compressor built already.
        error_feedback: ``None`` follows the node (a built compressor: not wrapped); ``True`` wraps
            (never twice), ``False`` does not.
        error_decay: error feedback's residual decay; ``None`` follows the node (else 1).
        prefix: how messages name the node's fields (``compressor.`` in a config, empty for keywords).
        name: the method's name, for messages.
    """
    if error_feedback is not None:
        check(f"{prefix}error_feedback", error_feedback, bool)
    if isinstance(node, Compressor):
        if error_feedback is False and isinstance(node, ErrorFeedback):
            raise ValueError(f"{prefix}error_feedback=False, but the compressor is wrapped in ErrorFeedback")
        built, wrap, decay = node, bool(error_feedback) and not isinstance(node, ErrorFeedback), error_decay
    else:
        kwargs = dict(node)
        node_feedback = bool(check(f"{prefix}error_feedback", kwargs.pop("error_feedback", None), bool | None))
        node_decay = kwargs.pop("error_decay", None)
        wrap = node_feedback if error_feedback is None else error_feedback
        decay = node_decay if error_decay is None else error_decay
        built = instantiate(kwargs, prefix.rstrip("."))
        if _is_hook_state(built):
            if wrap or decay is not None:
                raise ValueError(
                    f"{prefix}error_feedback does not apply to {_what(built, name)}, which keeps its own residuals"
                )
            return built
        if not isinstance(built, Compressor):
            raise TypeError(f"{prefix}_target_={kwargs.get('_target_')!r} did not build an lgc Compressor")
        if not wrap and error_feedback is None and node_decay is not None:
            raise ValueError(
                f"{prefix}error_decay={node_decay!r} is the decay of error feedback's residual: it needs "
                f"{prefix}error_feedback=true"
            )
    if not wrap:
        if error_decay is not None:
            raise ValueError(
                f"{prefix}error_decay={error_decay!r} is the decay of error feedback's residual, but {built!r} runs "
                f"without error feedback: pass {prefix}error_feedback=True, or a method whose yaml has it"
            )
        return built
    # The decay named as the config field it came from; ErrorFeedback refuses what it cannot wrap itself.
    return ErrorFeedback(built, decay=check(f"{prefix}error_decay", 1.0 if decay is None else decay, PositiveFraction))


def _field_names(cls: type) -> list[str]:
    return [field.name for field in dataclasses.fields(cls)]


def _comm(comm: Comm | Mapping[str, Any] | Any | None) -> Comm:
    """``comm`` as a :class:`Comm`: from a ``comm`` option (:mod:`lgc.comm`, or its config node) or a plain mapping."""
    if comm is None:
        return Comm()
    if isinstance(comm, DictConfig) and (option := OmegaConf.get_type(comm)) in COMM_OPTIONS.values():
        name = next(name for name, cls in COMM_OPTIONS.items() if cls is option)
        fields = _field_names(option)
        extra = [key for key in comm if key not in fields]  # added with Hydra's `+`, past the schema
        if extra:
            takes = [other for other, cls in COMM_OPTIONS.items() if extra[0] in _field_names(cls)]
            hint = f"; it is a setting of comm={'/'.join(takes)}" if takes else ""
            raise ValueError(
                f"comm.{extra[0]} is not a setting of comm={name} (its settings: {', '.join(fields)}){hint}"
            )
        missing = sorted(key.rpartition(".")[2] for key in OmegaConf.missing_keys(comm))
        if missing:
            raise ValueError(f"comm={name} needs comm.{missing[0]} (e.g. comm.{missing[0]}=4)")
        comm = OmegaConf.to_object(comm)
    if isinstance(comm, tuple(COMM_OPTIONS.values())):
        return comm.to_comm()
    return comm if isinstance(comm, Comm) else Comm.from_node(_plain(comm))


def _with_min_numel(node: dict[str, Any], comm: Comm, prefix: str) -> dict[str, Any]:
    """A hook state's node with ``comm.min_numel`` (the one place it is set), a compressor's node as it is."""
    if "min_numel" in node:
        raise ValueError(
            f"{prefix}min_numel={node['min_numel']!r}: which parameters go dense is the hook's setting, "
            f"{comm.prefix}min_numel"
        )
    target = _locate(node["_target_"]) if isinstance(node.get("_target_"), str) else None
    if isinstance(target, type) and not issubclass(target, Compressor) and "min_numel" in _init_parameters(target):
        return {**node, "min_numel": comm.min_numel}
    return node


def build_hook_state(
    method: Mapping[str, Any] | Compressor,
    comm: Comm | Mapping[str, Any] | EveryStep | LocalSGD | DiLoCo | None = None,
    *,
    error_feedback: bool | None = None,
    error_decay: float | None = None,
    process_group: dist.ProcessGroup | None = None,
    prefix: str = "compressor.",
    name: str | None = None,
) -> CompressionHookState | CommunicationDelayState | Any:
    """The hook state (not yet registered) of a compressor node or a built compressor, communicating as ``comm`` says.

    A compressor is applied every step (:class:`~lgc.ddp.CompressionHookState`), or, with
    ``comm.delay``, to the weight updates of ``delay`` local steps
    (:class:`~lgc.ddp.local_sgd.CommunicationDelayState`). A node whose ``_target_`` is a hook
    state (LGC, shared-index, PyTorch's hooks) is built as it is: it keeps its own residuals and
    dense warm-up, so error feedback, ``start_iter`` (and, for PyTorch's hooks, which compress
    every parameter, ``min_numel`` and ``delay``) are refused for it; one that takes ``min_numel``
    gets ``comm.min_numel``, and with ``comm.delay`` the LGC family exchanges the weight updates of
    the local steps, its stages counted in exchanges. ``comm``: a ``comm`` option (:mod:`lgc.comm`,
    or ``lgc-train``'s node of one), a :class:`~lgc.comm.Comm`, or a plain mapping of its fields.
    """
    comm = _comm(comm)
    method = _with_min_numel(_plain(method), comm, prefix) if isinstance(method, Mapping) else method
    local = comm.changed(*_LOCAL_STEP_FIELDS)
    if comm.delay is None and local:
        fields = ", ".join(comm.field(name) for name in _LOCAL_STEP_FIELDS)
        raise ValueError(f"{fields} act on the exchanges of local steps: they need {comm.prefix}delay")
    built = build_compressor(method, error_feedback=error_feedback, error_decay=error_decay, prefix=prefix, name=name)
    check_buffer_mode(comm.buffers, f"{comm.prefix}buffers")
    if comm.delay is not None and comm.changed("buffers"):
        raise ValueError(
            f"{comm.field('buffers')} applies to every-step exchanges; with {comm.field('delay')} each worker keeps "
            "its own buffers between exchanges and they are averaged at every exchange"
        )
    if comm.overlap and (_is_hook_state(built) or comm.delay is not None):
        what = f"{comm.field('delay')}, whose exchanges come after the optimizer" if comm.delay else _what(built, name)
        raise ValueError(
            f"{comm.field('overlap')} applies to an lgc compressor's every-step exchange (e.g. 'topk', 'sbc'), "
            f"not to {what}"
        )
    if comm.pack is not None and (_is_hook_state(built) or comm.delay is not None):
        what = f"{comm.field('delay')}, whose exchanges come after the optimizer" if comm.delay else _what(built, name)
        raise ValueError(
            f"{comm.field('pack')} applies to an lgc compressor's every-step exchange (e.g. 'topk', 'sbc'), "
            f"not to {what}"
        )
    if _is_hook_state(built):
        what = _what(built, name)
        if comm.delay is not None and not isinstance(built, CompressionHookState):
            raise ValueError(
                f"{comm.field('delay')} needs an lgc compressor (e.g. 'sbc', 'topk') or an LGC-family method "
                f"(lgc_rar, lgc_ps, shared_topk...), not {what}"
            )
        if comm.changed("start_iter"):
            raise ValueError(
                f"{comm.field('start_iter')} does not apply to {what}: its own knob sets the dense warm-up "
                "(LGC: stages.warmup_steps; PowerSGD: start_powerSGD_iter)"
            )
        if isinstance(built, TorchHookState) and comm.min_numel is not None:
            raise ValueError(
                f"{comm.field('min_numel')} does not apply to {what}: PyTorch's hook compresses every parameter"
            )
        if process_group is not None:
            built.process_group = process_group
        if comm.changed("buffers"):
            built.buffers = comm.buffers
        if comm.delay is not None:
            # LGC's family exchanges the weight updates as it exchanges gradients, stages counted in exchanges.
            return _delayed(built, comm, process_group)
        return built
    if comm.delay is not None:
        if comm.changed("start_iter"):
            raise ValueError(
                f"{comm.field('start_iter')} does not apply with {comm.field('delay')}: the local steps start at once"
            )
        # It refuses a compressor that applies weight decay itself (DGC): the updates carry it already.
        return _delayed(built, comm, process_group, min_numel=comm.min_numel)
    return CompressionHookState(
        built,
        min_numel=comm.min_numel,
        start_iter=comm.start_iter,
        process_group=process_group,
        overlap=comm.overlap,  # type: ignore[arg-type]
        buffers=comm.buffers,  # type: ignore[arg-type]
        pack=comm.pack,
    )


def compressor_chain(obj: Any) -> list[Any]:
    """``obj`` and everything it wraps through ``.compressor`` (ErrorFeedback, hook states), outermost first.

    Only the builder walks it, for the checks that must see through wrappers (error feedback
    around a sparsifier, the compressor whose rules need the optimizer's settings); everything
    else asks the outermost object, which forwards (:class:`~lgc.compressors.base.ForwardsHookCalls`).
    """
    chain = [obj]
    while (inner := getattr(chain[-1], "compressor", None)) is not None and len(chain) < 16:
        chain.append(inner)
    return chain


def check_error_feedback(state: Any, method: Any, error_feedback: bool | None, prefix: str | None = None) -> None:
    """Refuse a sparsifier (or EF-signSGD) built without error feedback unless ``error_feedback=False`` said so.

    ``prefix``: where a config gave the method (``compressor.``), so that the message names its field.
    """
    chain = compressor_chain(state)
    if any(isinstance(c, ErrorFeedback) for c in chain):
        diverges = getattr(chain[-1], "error_feedback_diverges", lambda: None)()
        if diverges:
            where = f"{prefix}error_feedback=true" if prefix is not None else "error feedback"
            raise ValueError(f"{type(chain[-1]).__name__} under {where}: {diverges}")
        return
    core = chain[-1]
    if not getattr(core, "needs_error_feedback", False) or error_feedback is False:
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
    if prefix is not None:
        raise ValueError(
            f"{name} without error feedback ({prefix}error_feedback unset): {loses}; set "
            f"{prefix}error_feedback=true, or {prefix}error_feedback=false to run it without, as asked"
        )
    fix = (
        f"wrap it: ErrorFeedback({name}(...)), or pass error_feedback=True"
        if isinstance(method, Compressor)
        else "build the state around ErrorFeedback(...)"
    )
    raise ValueError(f"{name} without error feedback: {loses}; {fix}; error_feedback=False runs it without, as asked")


def optimizer_rules_owner(state: Any) -> str:
    """The class name of the compressor in ``state`` whose rules need the optimizer's settings (DGC's)."""
    owner = next(c for c in compressor_chain(state) if isinstance(c, Compressor) and c.optimizer_settings_needed())
    return type(owner).__name__
