"""LGC-RAR: Learned Gradient Compression over ring-allreduce.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (2021), the
ring-allreduce variant. The paper gives few details of it; this is the design implemented here
(:mod:`lgc.learned.state` runs the stages, :mod:`lgc.learned.knobs` declares the common knobs).
Per compressed step and bucket:

1. Every worker forms ``v = residual + g`` (error feedback).
2. The leader selects its top-k positions ``I`` (``k = ceil(density * n)`` per parameter) and
   broadcasts them with its chunk scales (``4`` bytes per chunk; positions raw or Golomb-coded).
3. Every worker takes its own values ``x_i = v_i[I]``, cuts them into chunks, divides them by the
   leader's scales and encodes them: ``z_i = E(x_i)``.
4. The latents are summed with one allreduce (``torch.distributed.all_reduce``, a ring on NCCL),
   together with the small parameters that go dense.
5. Every worker decodes the mean latent, ``D(mean_i z_i)``, which the autoencoder was trained to
   map to ``mean_i x_i`` (the ``mean`` loss term), and applies it at ``I``.

Error feedback (``residual``): with ``"own_reconstruction"`` (default) each worker keeps
``x_i - D(z_i)`` at ``I``, what its *own* latent fails to carry (the only reconstruction it can
compute without more communication; the mean decode is not linear, so the aggregate's error is
not exactly the sum of these). With ``"zero"`` the residual is cleared at ``I`` as top-k does.
Everything outside ``I`` stays in the residual, so coordinates that only other workers find large
are not lost, only delayed until they become the leader's, or the leader rotates.

The leader rotates by default (``leaders.rotate=True``: worker ``t % P`` leads step ``t``, as
ScaleCom's cyclic leader), so no worker's large coordinates wait on one leader's view. On the
8-worker non-IID embedded task (``experiments/lgc_rotation.sh``, five seeds) it cut the relative
error of the delivered sum from 0.88-0.91 to 0.58-0.60 on the three seeds where the autoencoder
worked; on the other two the codec failed with either leader (error about 1.0), and the
accuracies over the five seeds do not separate the two leaders. ``leaders.rotate=False`` keeps
``leaders.rank``.

``latent_dtype="int8"`` quantizes the latent as shared-index int8 quantizes values
(:mod:`lgc.learned.shared_index`): one scale per chunk's latent shared by every worker (the largest
magnitude over the workers, one allreduce-max of 4 bytes per chunk), unbiased stochastic rounding to
``2m + 1`` levels with ``m = 255 // (2P)``, and the codes summed in 8-bit lanes that hold ``P``
workers' sum without overflow (``P <= 127``). The decoder gets the sum of what the workers sent; each
worker's own reconstruction (its residual) decodes its own rounded latent.

Bytes per worker and bucket: the latent (``K / 4`` floats by default, half that in fp16, a quarter
plus the scales in int8), the dense small parameters, and the leader's broadcast (``4 K`` bytes
raw, about ``1.4 K`` Golomb-coded at density 0.001, plus the scales). With ``refresh_threshold``
set, each worker's reconstruction error rides along in the allreduce (4 bytes), so all workers
decide a refresh alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist

from lgc.compressors.topk import to_wire_float
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.learned.knobs import CodecTrainingKnobs, LeaderChoice, Stages, knob_group
from lgc.learned.shared_index import SharedIndexStage, quantization_levels, shared_scale_codes
from lgc.learned.state import LGCHookState
from lgc.learned.step import LATENT_DTYPES, Leaders, StepContext, latent_wire_dtype, send_parameters
from lgc.learned.training import CodecTraining
from lgc.validation import Density, Seed

__all__ = ["LGCRingAllreduceState", "RingAllreduceStage"]

RESIDUALS = ("own_reconstruction", "zero")


class RingAllreduceStage:
    """LGC-RAR's compressed stage: encode at the leader's positions, allreduce the latents, decode the mean.

    Args:
        residual: ``"own_reconstruction"`` keeps what this worker's own latent does not carry;
            ``"zero"`` clears the residual at the leader's positions.
        latent_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` latents on the wire, or
            ``"int8"``: shared per-chunk scales, stochastic rounding, summed in 8-bit lanes.
        seed: seed of the int8 latents' stochastic rounding (every worker's draws differ, seeded by
            ``seed``, the step and its rank; a resumed run repeats them).
    """

    __slots__ = ("latent_dtype", "residual", "seed", "wire_dtype")

    def __init__(self, residual: str = "own_reconstruction", latent_dtype: str = "float32", seed: int = 0) -> None:
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
        if latent_dtype not in (*LATENT_DTYPES, "int8"):
            raise ValueError(f"latent_dtype must be one of {[*sorted(LATENT_DTYPES), 'int8']}, got {latent_dtype!r}")
        self.residual = residual
        self.latent_dtype = latent_dtype
        self.wire_dtype = torch.uint8 if latent_dtype == "int8" else latent_wire_dtype(latent_dtype)
        self.seed = int(seed)

    def check_world(self, world_size: int) -> None:
        if self.latent_dtype == "int8" and quantization_levels(8, world_size) < 1:
            raise ValueError(
                f"latent_dtype='int8' cannot hold the sum of {world_size} workers' codes in 8-bit lanes "
                "(at most 127 workers); use a float latent_dtype"
            )

    def distribute_weights(self, codec: torch.nn.Module, leaders: Leaders, stats: CommStats, group: Any) -> None:
        # Only rank 0 trained; every worker encodes and decodes, so everyone gets everything.
        send_parameters(stats, list(codec.parameters()), None, group)
        codec.eval()

    @torch.no_grad()
    def run(self, ctx: StepContext) -> None:
        plan, world_size, code = ctx.plan, ctx.world_size, ctx.code
        refresh = ctx.schedule.refresh_threshold is not None
        if not plan.compressed:
            ctx.allreduce_dense([])
            return
        ae = ctx.codec
        v = ctx.corrected()
        ctx.mark_sent()
        positions, scales, _ = ctx.leader_message(v)
        assert scales is not None
        values = v[positions]
        rows = scales.numel()
        encoded = ae.encode(code.scaled_chunks(values, scales))
        if self.latent_dtype == "int8":
            latent, latent_scales, levels = self._quantized(ctx, encoded.reshape(rows, -1))
            ctx.count_payload(counted.nbytes(latent))  # the scales' allreduce-max is booked already
            # What this worker sent: its codes at the shared scales.
            own_codes = latent.float().view(rows, -1) - levels
            own_latent = (own_codes / levels * latent_scales[:, None]).view(ae.latent_shape(rows))
        else:
            latent = to_wire_float(encoded, self.wire_dtype, ctx.world_size).reshape(-1)
            ctx.count_payload(counted.nbytes(latent))
            own_latent = latent.float().view(ae.latent_shape(rows))
        # The worker's own reconstruction serves its residual and the refresh's error. The refresh's
        # error rides in the allreduce, so it is decoded first; otherwise both decodes are one call
        # after the allreduce, and none is needed with residual="zero" and no refresh.
        own_needed = self.residual == "own_reconstruction" or refresh
        own = code.unscaled(ae.decode(own_latent), scales, plan.k) if refresh else None
        error_part = [v.new_tensor([_own_error(values, own, ctx.metrics)])] if own is not None else []

        # The latent rides with the dense parameters in one allreduce when it is fp32, else its own.
        if latent.dtype == torch.float32:
            summed = ctx.allreduce_dense([*error_part, latent])
            assert summed is not None
            summed_error, latent_sum = summed[: len(error_part)], summed[len(error_part) :]
        else:
            summed_error = ctx.allreduce_dense(error_part)
            counted.all_reduce(ctx.stats, latent, ctx.group).wait()
            latent_sum = latent.float()
            if self.latent_dtype == "int8":
                # Offset codes in [0, 2m] summed in 8-bit lanes: P workers' sum stays below 256.
                offsets = latent_sum.view(rows, -1) - world_size * levels
                latent_sum = (offsets / levels * latent_scales[:, None]).view(-1)
        if refresh:
            assert summed_error is not None
            # Mean relative error over the workers, weighted by the step's values.
            ctx.schedule.record_error(float(summed_error[0]) / world_size, plan.k)
        mean_latent = (latent_sum / world_size).view(ae.latent_shape(rows))
        if own_needed and own is None:
            decoded = ae.decode(torch.cat([own_latent, mean_latent]))
            own = code.unscaled(decoded[:rows], scales, plan.k)
            _own_error(values, own, ctx.metrics)
            mean_chunks = decoded[rows:]
        else:
            mean_chunks = ae.decode(mean_latent)
        mean_values = code.unscaled(mean_chunks, scales, plan.k)
        if self.residual == "own_reconstruction":
            assert own is not None  # decoded above: first for the refresh, or with the mean
            v[positions] = values - own
        else:
            v[positions] = 0.0
        ctx.keep(v)
        ctx.measure_error(values, mean_values * world_size)
        # Each worker's share is already divided by the world size: the sum is the mean gradient.
        ctx.apply(positions, mean_values * world_size, like=v)

    def _quantized(self, ctx: StepContext, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``[rows, latent_numel]`` -> offset codes (uint8), the shared per-chunk scales and the levels ``m``."""
        levels = quantization_levels(8, ctx.world_size)
        codes, scales = shared_scale_codes(ctx, latent, levels, self.seed)
        return (codes + levels).to(torch.uint8).reshape(-1), scales, levels


def _own_error(values: torch.Tensor, own: torch.Tensor, metrics: dict[str, float]) -> float:
    """Relative error of this worker's own reconstruction (logged as ``lgc/recon_error``)."""
    error, norm = float((values - own).square().sum()), float(values.square().sum())
    relative = error / norm if norm > 0 else 0.0
    metrics["lgc/recon_error"] = relative
    return relative


#: LGC-RAR's presets (lgc_rar.yaml's): its stages, its rotating leader, its codec training.
_STAGES = Stages()
_LEADERS = LeaderChoice()
_TRAINING = CodecTrainingKnobs()


class LGCRingAllreduceState(LGCHookState):
    """LGC-RAR (``compressor=lgc_rar``): workers sum autoencoder latents with an allreduce.

    The defaults are ``lgc/conf/compressor/lgc_rar.yaml``'s (the embedded task's scale: 1 %
    density, 30 warm-up steps, 60 steps of codec training); ``lgc_rar_paper.yaml`` has the paper's.

    Args:
        density: top-k density of the leader's selection and of stage 2 (``k = ceil(density * n)``
            per parameter). The paper uses 0.001.
        stages: the stages (:class:`~lgc.learned.knobs.Stages`, or a mapping of the fields to change).
        leaders: whose positions (:class:`~lgc.learned.knobs.LeaderChoice`; rotating by default,
            see the module docstring).
        training: the codec and its training (:class:`~lgc.learned.knobs.CodecTrainingKnobs`):
            the autoencoder (the paper's), the linear codec (the top principal directions of the
            same samples, :class:`~lgc.autoencoder.linear.LinearChunkCodec`: LGC's learned but
            linear ablation, exact for the sum since decoding is linear) or the PCA-initialised
            autoencoder; what stage 2 learns from (``samples``).
        residual, latent_dtype, seed: the compressed stage's knobs (:class:`RingAllreduceStage`).
        measure_error, world_size, min_numel, process_group: as
            :class:`~lgc.learned.state.LGCHookState`'s.

    Example::

        >>> state = LGCRingAllreduceState(density=0.01, stages={"warmup_steps": 20, "ae_steps": 50})
        >>> state.register(ddp_model)  # then train as usual; state.metrics()["lgc/stage"] tells the stage
    """

    __slots__ = ()
    #: The presets (a mapping given for a group changes their fields; a dataclass replaces them).
    STAGES: ClassVar[Stages] = _STAGES
    LEADERS: ClassVar[LeaderChoice] = _LEADERS
    TRAINING: ClassVar[CodecTrainingKnobs] = _TRAINING

    def __init__(
        self,
        *,
        density: Density = 0.01,
        stages: Stages | Mapping[str, Any] = _STAGES,
        leaders: LeaderChoice | Mapping[str, Any] = _LEADERS,
        training: CodecTrainingKnobs | Mapping[str, Any] = _TRAINING,
        residual: Literal["own_reconstruction", "zero"] = "own_reconstruction",
        latent_dtype: Literal["float32", "float16", "bfloat16", "int8"] = "float32",
        seed: Seed = 0,
        measure_error: bool = False,
        world_size: int | None = None,
        min_numel: int | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        knobs = knob_group(training, _TRAINING)
        exchange = SharedIndexStage("float32") if knobs.samples == "leader" else None
        super().__init__(
            RingAllreduceStage(residual, latent_dtype, seed),
            CodecTraining(knobs, sample_exchange=exchange),
            density=density,
            stages=knob_group(stages, _STAGES),
            leaders=knob_group(leaders, _LEADERS),
            measure_error=measure_error,
            world_size=world_size,
            min_numel=min_numel,
            process_group=process_group,
        )

    def describe(self) -> str:
        return self.learned_description(self.compressed_stage.latent_dtype)
