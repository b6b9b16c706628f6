"""LGC-RAR: Learned Gradient Compression over ring-allreduce.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (2021), the
ring-allreduce variant. The paper gives few details of it; this is the design implemented here
(:mod:`lgc.learned.state` has the stages and the common knobs). Per compressed step and bucket:

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

The leader rotates by default (``rotate_leader=True``: worker ``t % P`` leads step ``t``, as
ScaleCom's cyclic leader), so no worker's large coordinates wait on one leader's view. On the
8-worker non-IID embedded task (``experiments/lgc_rotation.sh``, five seeds) it cut the relative
error of the delivered sum from 0.88-0.91 to 0.58-0.60 on the three seeds where the autoencoder
worked; on the other two the codec failed with either leader (error about 1.0), and the
accuracies over the five seeds do not separate the two leaders. ``rotate_leader=False`` keeps
``leader_rank``.

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
from typing import Any

import torch

from lgc.autoencoder import AutoencoderConfig
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.learned.shared_index import SharedIndexStage, quantization_levels, shared_scale_codes
from lgc.learned.state import LGCHookState
from lgc.learned.step import LATENT_DTYPES, Leaders, StepContext, latent_wire_dtype, send_parameters
from lgc.learned.training import CodecTraining
from lgc.validation import NonNegativeInt

__all__ = ["LGCRingAllreduceState", "RingAllreduceStage"]

RESIDUALS = ("own_reconstruction", "zero")
#: What LGC-RAR's codec-training stage communicates and learns from.
CODEC_SAMPLES = ("topk", "leader")


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
            latent = encoded.to(self.wire_dtype).reshape(-1)
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


class LGCRingAllreduceState(LGCHookState):
    """LGC-RAR (``compressor=lgc_rar``): workers sum autoencoder latents with an allreduce.

    Args:
        residual, latent_dtype, seed: the compressed stage's knobs (:class:`RingAllreduceStage`).
        codec: ``"autoencoder"`` (the paper's), ``"linear"``: the top principal directions of the
            same samples (:class:`~lgc.autoencoder.linear.LinearChunkCodec`, LGC's learned but
            linear ablation; exact for the sum, since decoding is linear), or ``"pca_autoencoder"``:
            those directions plus a nonlinear correction that starts at zero and trains on the
            autoencoder's loss (:class:`~lgc.autoencoder.pca_autoencoder.PCAAutoencoder`).
        linear_latent: the linear and PCA-initialised codecs' floats per chunk (default: the
            autoencoder's ``latent_numel``, so all send the same bytes).
        pca_hidden: the PCA-initialised codec's correction width (0: none, the linear codec).
        rotate_leader: worker ``t % P`` leads step ``t`` (the default, see the module docstring).
        codec_samples: what stage 2 communicates and learns from: ``"topk"`` (the paper: top-k with
            error feedback, the samples are every worker's corrected gradient at the leader's
            positions) or ``"leader"``: the compressed stage's exchange with the exact sum in place
            of the codec (shared-index float32), so the samples come from the error feedback the
            codec will serve (:mod:`lgc.learned.training`).
        autoencoder, ae_updates_per_step, ae_optimizer, ae_lr, ae_batch_size, ae_buffer_size, loss_weights:
            the codec and its training (:class:`~lgc.learned.training.CodecTraining`).
        **kwargs: the stages and common knobs of :class:`~lgc.learned.state.LGCHookState`.

    Example::

        >>> state = LGCRingAllreduceState(density=0.01, warmup_steps=20, ae_steps=50)
        >>> state.register(ddp_model)  # then train as usual; state.metrics()["lgc/stage"] tells the stage
    """

    __slots__ = ()

    def __init__(
        self,
        *,
        residual: str = "own_reconstruction",
        latent_dtype: str = "float32",
        seed: int = 0,
        codec: str = "autoencoder",
        linear_latent: int | None = None,
        pca_hidden: NonNegativeInt = 64,
        autoencoder: Mapping[str, Any] | AutoencoderConfig | None = None,
        ae_updates_per_step: NonNegativeInt = 1,
        ae_optimizer: str = "adam",
        ae_lr: float = 1e-3,
        ae_batch_size: int = 64,
        ae_buffer_size: int = 4096,
        loss_weights: Mapping[str, float] | None = None,
        rotate_leader: bool = True,
        codec_samples: str = "topk",
        **kwargs: Any,
    ) -> None:
        if codec_samples not in CODEC_SAMPLES:
            raise ValueError(f"codec_samples must be one of {CODEC_SAMPLES}, got {codec_samples!r}")
        stage = RingAllreduceStage(residual, latent_dtype, seed)
        training = CodecTraining(
            codec=codec,
            linear_latent=linear_latent,
            pca_hidden=pca_hidden,
            autoencoder=autoencoder,
            ae_updates_per_step=ae_updates_per_step,
            ae_optimizer=ae_optimizer,
            ae_lr=ae_lr,
            ae_batch_size=ae_batch_size,
            ae_buffer_size=ae_buffer_size,
            loss_weights=loss_weights,
            sample_exchange=SharedIndexStage("float32") if codec_samples == "leader" else None,
        )
        super().__init__(stage, training, rotate_leader=rotate_leader, **kwargs)

    def describe(self) -> str:
        return self.learned_description(self.compressed_stage.latent_dtype)
