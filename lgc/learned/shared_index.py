"""LGC's ablations: the leader's shared top-k positions without the autoencoder.

LGC's compressed stage does two things: every worker sends values at the *same* positions (the
leader's top-k, so values line up and can be summed by an allreduce, and no worker sends its own
indices), and an autoencoder compresses those values. These codecs keep the first and replace the
second with something simpler, so a run shows what the learning adds:

* **shared-index top-k** (``compressor=shared_topk``): every worker's values at the leader's
  positions, summed by one allreduce, in ``values="float32"`` (exact), ``"float16"`` or
  ``"bfloat16"`` (each chunk divided by the leader's chunk scale first, so small gradients do not
  underflow), or ``"int8"`` / ``"int4"``: unbiased stochastic rounding to ``2m + 1`` levels of a
  per-chunk scale shared by every worker (the largest magnitude of the chunk over the workers, one
  allreduce-max of 4 bytes per chunk). The codes are summed in ``bits``-wide unsigned lanes (two
  4-bit lanes per byte), so ``m = floor((2^bits - 1) / (2 P))`` leaves room for the sum of ``P``
  workers without overflow: 8 bits give 31 levels per worker at ``P = 8``; 4 bits need ``P <= 7``
  (3 levels) and are refused beyond.
* **leader-scaled** (``compressor=leader_scaled``, ``leader_only=True``): only the leader sends
  values (with its positions, one broadcast), and every worker applies ``P`` times them, the
  trivial estimate of the sum. No allreduce of values at all.

Error feedback at the leader's positions keeps what this worker's own contribution failed to
carry: its rounding error (quantized formats), zero (exact formats), or ``v_i - v_leader``
(leader-scaled: the estimate credited every worker with the leader's value, so the residuals
over all workers keep exactly the estimate's error). Everything outside the positions stays in
the residual, as in LGC.

The leader rotates by default (``leaders.rotate=True``: worker ``t % P`` leads step ``t``, as
ScaleCom's cyclic leader), so every worker's largest coordinates get their turn instead of piling
up in its residual where a fixed leader never looks. On the 8-worker non-IID embedded task
(``experiments/lgc_rotation.sh``) it cut the error of int8's delivered sum about 7x (0.054 to
0.0074) at the same accuracy over three seeds, and it is what makes leader-scaled learn from every
worker's data rather than the fixed leader's shard (0.925 to 0.972, one seed). ``leaders.rotate=False``
keeps ``leaders.rank``.

The stages are LGC's (:mod:`lgc.learned.schedule`) without codec training: warm-up (dense or
DGC-style), then the compressed stage. Nothing is learned, so these states hold no codec trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor, nn

from lgc.coding import pack_uint, unpack_uint
from lgc.compressors.topk import to_wire_float
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.learned.knobs import LeaderChoice, Stages, knob_group
from lgc.learned.state import LGCHookState
from lgc.learned.step import Leaders, StepContext
from lgc.validation import Density, Seed, check

__all__ = [
    "VALUE_FORMATS",
    "ScaleChunk",
    "SharedIndexStage",
    "SharedIndexState",
    "quantization_levels",
    "round_to_levels",
    "shared_scale_codes",
]

#: Wire formats of the values: name -> (dtype on the wire, bits per value).
VALUE_FORMATS = {"float32": 32, "float16": 16, "bfloat16": 16, "int8": 8, "int4": 4}
_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Values per chunk of the per-chunk scales.
ScaleChunk = Annotated[int, Field(ge=2, multiple_of=2, description="an even integer >= 2")]


def quantization_levels(bits: int, world_size: int) -> int:
    """``m``: each worker's codes lie in ``[-m, m]``, so ``P`` workers' offset codes sum below ``2^bits``."""
    return (2**bits - 1) // (2 * world_size)


def round_to_levels(chunks: Tensor, scales: Tensor, levels: int, noise: Tensor) -> Tensor:
    """Unbiased stochastic rounding of ``chunks / scales`` (per row) to the integers ``-levels .. levels``.

    ``noise``: uniform draws in [0, 1) shaped like ``chunks``; a value ``x`` of a row with scale
    ``s`` becomes ``floor(x / s * levels + u)``, whose mean over ``u`` is ``x / s * levels``.
    """
    return torch.floor(chunks / scales[:, None] * levels + noise).clamp_(-levels, levels)


def shared_scale_codes(ctx: StepContext, rows: Tensor, levels: int, seed: int) -> tuple[Tensor, Tensor]:
    """Every row of ``rows`` rounded (:func:`round_to_levels`) to a scale every worker shares.

    The scale of a row is its largest magnitude over the workers (one allreduce-max of 4 bytes per
    row, 1.0 for an all-zero row); the draws are seeded by ``seed``, the step and the rank, so
    every worker's differ and a resumed run repeats them. Returns the integer codes and the scales.
    """
    scales = rows.abs().amax(dim=1)
    counted.all_reduce(ctx.stats, scales, ctx.group, op=dist.ReduceOp.MAX).wait()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    generator = torch.Generator(device=rows.device).manual_seed((seed * 1_000_003 + ctx.step) * 65_537 + ctx.rank)
    noise = torch.rand(rows.shape, generator=generator, device=rows.device)
    return round_to_levels(rows, scales, levels, noise), scales


class SharedIndexStage:
    """The shared-index compressed stage: every worker's values at the leader's positions, summed.

    Args:
        values: wire format of the values: ``"float32"``, ``"float16"``, ``"bfloat16"``,
            ``"int8"`` or ``"int4"`` (see the module docstring).
        leader_only: send only the leader's values and apply ``P`` times them (leader-scaled);
            float formats only.
        seed: seed of the stochastic rounding (quantized formats); every worker's draws differ
            (seeded by ``seed``, the step and its rank) and a resumed run repeats them.
    """

    __slots__ = ("leader_only", "seed", "values")

    def __init__(self, values: str = "float32", leader_only: bool = False, seed: int = 0) -> None:
        if values not in VALUE_FORMATS:
            raise ValueError(f"values must be one of {sorted(VALUE_FORMATS)}, got {values!r}")
        if leader_only and values not in _FLOAT_DTYPES:
            raise ValueError(
                f"leader_only sends the leader's values as they are: values must be a float format, got {values!r}"
            )
        self.values = values
        self.leader_only = check("leader_only", leader_only, bool)
        self.seed = int(seed)

    def check_world(self, world_size: int) -> None:
        bits = VALUE_FORMATS[self.values]
        if bits < 16 and quantization_levels(bits, world_size) < 1:
            raise ValueError(
                f"values={self.values!r} cannot hold the sum of {world_size} workers' codes in {bits}-bit lanes "
                f"(at most {(2**bits - 1) // 2} workers); use values='int8' or a float format"
            )

    def distribute_weights(self, codec: nn.Module, leaders: Leaders, stats: CommStats, group: Any) -> None:
        pass  # nothing is learned (never called: these states hold no codec)

    def run(self, ctx: StepContext) -> None:
        self.exchange(ctx)

    @torch.no_grad()
    def exchange(self, ctx: StepContext) -> Tensor | None:
        """Run the step (as :meth:`run`); return this worker's values at the leader's positions, in wire order.

        ``None`` when the step compresses no parameter. LGC's codec training with
        ``training.samples="leader"`` runs the exact (float32) exchange and learns from these values.
        """
        plan = ctx.plan
        if not plan.compressed:
            ctx.allreduce_dense([])
            return None
        v = ctx.corrected()
        ctx.mark_sent()
        if self.leader_only:
            positions, _, leader_values = ctx.leader_message(v, scales=False, values=_FLOAT_DTYPES[self.values])
            assert leader_values is not None
            ctx.count_payload()
            own = v[positions]
            total = leader_values.to(v.dtype) * ctx.world_size
            v[positions] = own - leader_values.to(v.dtype)
            ctx.allreduce_dense([])
        else:
            scaled = self.values in ("float16", "bfloat16")
            positions, scales, _ = ctx.leader_message(v, scales=scaled)
            own = v[positions]
            if self.values in _FLOAT_DTYPES:
                total, carried = self._sum_floats(ctx, own, scales)
            else:
                total, carried = self._sum_quantized(ctx, own)
            v[positions] = own - carried
        ctx.measure_error(own, total)
        ctx.keep(v)
        # Each worker's share is already divided by the world size: the sum is the mean gradient.
        ctx.apply(positions, total, like=v)
        return own

    def _sum_floats(self, ctx: StepContext, own: Tensor, scales: Tensor | None) -> tuple[Tensor, Tensor]:
        """Allreduce the values in a float format; returns (the sum, what this worker's values carried)."""
        dtype = _FLOAT_DTYPES[self.values]
        plan, code = ctx.plan, ctx.code
        if scales is None:
            wire = own.to(dtype)
            carried = wire.float()
        else:
            # Scaled by the leader's chunk RMS: another worker's chunk may exceed fp16's range there.
            wire = to_wire_float(code.scaled_chunks(own, scales), dtype, ctx.world_size)
            carried = code.unscaled(wire.float(), scales, plan.k)
        ctx.count_payload(counted.nbytes(wire))
        if dtype == torch.float32:
            summed = ctx.allreduce_dense([wire.reshape(-1)])
            assert summed is not None
        else:
            ctx.allreduce_dense([])
            counted.all_reduce(ctx.stats, wire, ctx.group).wait()
            summed = wire
        if scales is None:
            return summed.float(), carried
        return code.unscaled(summed.float().view(-1, code.chunk), scales, plan.k), carried

    def _sum_quantized(self, ctx: StepContext, own: Tensor) -> tuple[Tensor, Tensor]:
        """Stochastic rounding to shared per-chunk scales, summed in ``bits``-wide lanes."""
        plan, code, world_size = ctx.plan, ctx.code, ctx.world_size
        bits = VALUE_FORMATS[self.values]
        levels = quantization_levels(bits, world_size)
        chunks = code.chunks(own)
        codes, scales = shared_scale_codes(ctx, chunks, levels, self.seed)
        carried = code.unscaled(codes / levels, scales, plan.k)
        # Offset-binary codes in [0, 2m], packed bits wide: P workers' sums stay below 2**bits, so no lane carries.
        lanes = pack_uint((codes + levels).to(torch.uint8), bits)
        ctx.count_payload(counted.nbytes(lanes))  # the scales' allreduce-max is booked already
        ctx.allreduce_dense([])
        counted.all_reduce(ctx.stats, lanes, ctx.group).wait()
        summed = unpack_uint(lanes, bits, chunks.numel(), dtype=torch.uint8).to(torch.float32) - world_size * levels
        return code.unscaled(summed.view_as(chunks) / levels, scales, plan.k), carried


#: The shared-index codecs' presets: no codec-training stage; values in position order.
_STAGES = Stages(ae_steps=0)
_LEADERS = LeaderChoice(value_order="position")


class SharedIndexState(LGCHookState):
    """The leader's top-k positions, every worker's values there summed, no codec.

    The defaults are ``lgc/conf/compressor/shared_topk.yaml``'s.

    Args:
        density: top-k density of the leader's selection (``k = ceil(density * n)`` per parameter).
        stages: the warm-up (:class:`~lgc.learned.knobs.Stages`, or a mapping of the fields to
            change); there is no codec-training stage (``ae_steps`` 0) and no refresh.
        leaders: whose positions (:class:`~lgc.learned.knobs.LeaderChoice`): rotating (see the
            module docstring), values in ``"position"`` order, the cheapest with Golomb-coded
            positions, since nothing here depends on the order.
        values, leader_only, seed: the compressed stage's knobs (:class:`SharedIndexStage`).
        chunk: values per chunk of the per-chunk scales (float16/bfloat16: the leader's RMS;
            int8/int4: the largest magnitude over the workers): 4 bytes per ``chunk`` values.
        measure_error, world_size, min_numel, process_group: as
            :class:`~lgc.learned.state.LGCHookState`'s.

    Example::

        >>> state = SharedIndexState(density=0.01, stages={"warmup_steps": 20}, values="int8")
        >>> state.register(ddp_model)
    """

    __slots__ = ()
    #: The presets (a mapping given for a group changes their fields; a dataclass replaces them).
    STAGES: ClassVar[Stages] = _STAGES
    LEADERS: ClassVar[LeaderChoice] = _LEADERS

    def __init__(
        self,
        *,
        density: Density = 0.01,
        stages: Stages | Mapping[str, Any] = _STAGES,
        leaders: LeaderChoice | Mapping[str, Any] = _LEADERS,
        values: Literal["float32", "float16", "bfloat16", "int8", "int4"] = "float32",
        leader_only: bool = False,
        seed: Seed = 0,
        chunk: ScaleChunk = 64,
        measure_error: bool = False,
        world_size: int | None = None,
        min_numel: int | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        check("chunk", chunk, ScaleChunk)
        super().__init__(
            SharedIndexStage(values, leader_only, seed),
            None,
            chunk,
            density=density,
            stages=knob_group(stages, _STAGES),
            leaders=knob_group(leaders, _LEADERS),
            measure_error=measure_error,
            world_size=world_size,
            min_numel=min_numel,
            process_group=process_group,
        )

    def describe(self) -> str:
        stage = self.compressed_stage
        kind = "leader-scaled" if stage.leader_only else "shared-index top-k"
        return (
            f"{type(self).__name__}({kind}, density={self.density}, values={stage.values}, "
            f"warmup_steps={self.warmup_steps} ({self.warmup}), indices={self.index_coding})"
        )
