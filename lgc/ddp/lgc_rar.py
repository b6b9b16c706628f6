"""LGC-RAR: Learned Gradient Compression over ring-allreduce.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (2021), the
ring-allreduce variant. The paper gives few details of it; this is the design implemented here
(:mod:`lgc.ddp.lgc_base` has the stages and the common knobs). Per compressed step and bucket:

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

Bytes per worker and bucket: the latent (``K / 4`` floats by default, or half that in fp16), the
dense small parameters, and the leader's broadcast (``4 K`` bytes raw, about ``1.4 K`` Golomb-coded
at density 0.001, plus the scales). With ``refresh_threshold`` set, each worker's reconstruction
error rides along in the allreduce (4 bytes), so all workers decide a refresh alike.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from typing import Any

import torch
import torch.distributed as dist

from lgc.autoencoder import AutoencoderConfig
from lgc.autoencoder.linear import LinearChunkCodec, LinearCodecTrainer
from lgc.ddp import collectives as counted
from lgc.ddp.lgc_base import LGCHookState, StepPlan

__all__ = ["LGCRingAllreduceState"]

_RESIDUALS = ("own_reconstruction", "zero")
_CODECS = ("autoencoder", "linear")


class LGCRingAllreduceState(LGCHookState):
    """LGC-RAR (``compressor=lgc_rar``): workers sum autoencoder latents with an allreduce.

    Args:
        residual: ``"own_reconstruction"`` keeps what this worker's own latent does not carry;
            ``"zero"`` clears the residual at the leader's positions.
        codec: ``"autoencoder"`` (the paper's) or ``"linear"``: the top principal directions of the
            same samples (:class:`~lgc.autoencoder.linear.LinearChunkCodec`, LGC's learned but
            linear ablation; exact for the sum, since decoding is linear).
        linear_latent: the linear codec's floats per chunk (default: the autoencoder's
            ``latent_numel``, so both send the same bytes).
        **kwargs: the stages and common knobs of :class:`~lgc.ddp.lgc_base.LGCHookState`.

    Example::

        >>> state = LGCRingAllreduceState(density=0.01, warmup_steps=20, ae_steps=50)
        >>> state.register(ddp_model)  # then train as usual; state.metrics()["lgc/stage"] tells the stage
    """

    __slots__ = ("residual", "codec", "linear_latent")

    def __init__(
        self,
        *,
        residual: str = "own_reconstruction",
        codec: str = "autoencoder",
        linear_latent: int | None = None,
        **kwargs: Any,
    ) -> None:
        if residual not in _RESIDUALS:
            raise ValueError(f"residual must be one of {_RESIDUALS}, got {residual!r}")
        if codec not in _CODECS:
            raise ValueError(f"codec must be one of {_CODECS}, got {codec!r}")
        if linear_latent is not None and codec != "linear":
            raise ValueError(f"linear_latent={linear_latent!r} is the linear codec's knob, but codec={codec!r}")
        self.residual = residual
        self.codec = codec
        self.linear_latent = linear_latent
        kwargs.setdefault("rotate_leader", True)
        super().__init__(**kwargs)

    def _make_trainer(self) -> Any:
        if self.codec == "autoencoder":
            return super()._make_trainer()
        # As many latent floats per chunk as the autoencoder's by default: the same bytes on the wire.
        latent = self.linear_latent if self.linear_latent is not None else self.ae_config.latent_numel
        codec = LinearChunkCodec(self.ae_config.chunk, latent)
        return LinearCodecTrainer(codec, buffer_size=self.trainer_options["buffer_size"])

    def _autoencoder_config(self, config: AutoencoderConfig, world_size: int | None) -> AutoencoderConfig:
        return AutoencoderConfig(**{**vars(config), "num_decoders": 1, "innovation": False})

    def _distribute_weights(self) -> None:
        # Only rank 0 trained; every worker encodes and decodes, so everyone gets everything.
        self._send_flat_parameters(list(self.autoencoder.parameters()), None)
        self.autoencoder.eval()

    @torch.no_grad()
    def _compressed_step(self, plan: StepPlan) -> None:
        world_size = dist.get_world_size(self.process_group)
        refresh = self.refresh_threshold is not None
        if not plan.compressed:
            self._allreduce_dense(plan, [])
            return
        ae = self.autoencoder
        v = plan.corrected(self.ef.residuals)
        sent_before = self.stats.bytes_sent
        positions, scales, _ = self._leader_message(plan, v)
        assert scales is not None
        values = v[positions]
        latent = self._wire_latent(ae.encode(self.leader_code.scaled_chunks(values, scales)))
        self._count_payload(self.stats.bytes_sent - sent_before + counted.nbytes(latent), plan)
        rows = scales.numel()
        own_latent = latent.float().view(ae.latent_shape(rows))
        # The worker's own reconstruction serves its residual and the refresh's error. The refresh's
        # error rides in the allreduce, so it is decoded first; otherwise both decodes are one call
        # after the allreduce, and none is needed with residual="zero" and no refresh.
        own_needed = self.residual == "own_reconstruction" or refresh
        own = self.leader_code.unscaled(ae.decode(own_latent), scales, plan.k) if refresh else None
        error_part = [v.new_tensor([self._own_error(values, own)])] if own is not None else []

        # The latent rides with the dense parameters in one allreduce when it is fp32, else its own.
        if latent.dtype == torch.float32:
            summed = self._allreduce_dense(plan, [*error_part, latent])
            assert summed is not None
            summed_error, latent_sum = summed[: len(error_part)], summed[len(error_part) :]
        else:
            summed_error = self._allreduce_dense(plan, error_part)
            counted.all_reduce(self.stats, latent, self.process_group).wait()
            latent_sum = latent.float()
        if refresh:
            assert summed_error is not None
            # Mean relative error over the workers, weighted by the step's values.
            self.step_error[0] += float(summed_error[0]) / world_size * plan.k
            self.step_error[1] += plan.k
        mean_latent = (latent_sum / world_size).view(ae.latent_shape(rows))
        if own_needed and own is None:
            decoded = ae.decode(torch.cat([own_latent, mean_latent]))
            own = self.leader_code.unscaled(decoded[:rows], scales, plan.k)
            self._own_error(values, own)
            mean_chunks = decoded[rows:]
        else:
            mean_chunks = ae.decode(mean_latent)
        mean_values = self.leader_code.unscaled(mean_chunks, scales, plan.k)
        if self.residual == "own_reconstruction":
            assert own is not None  # decoded above: first for the refresh, or with the mean
            v[positions] = values - own
        else:
            v[positions] = 0.0
        plan.keep_residuals(self.ef.residuals, v)
        self._measure_error(values, mean_values * world_size)
        update = torch.zeros(plan.numel, dtype=v.dtype, device=v.device)
        # Each worker's share is already divided by the world size: the sum is the mean gradient.
        update[positions] = (mean_values * world_size).to(v.dtype)
        plan.scatter(update)

    def _own_error(self, values: torch.Tensor, own: torch.Tensor) -> float:
        """Relative error of this worker's own reconstruction (logged as ``lgc/recon_error``)."""
        error, norm = float((values - own).square().sum()), float(values.square().sum())
        relative = error / norm if norm > 0 else 0.0
        self.last_metrics["lgc/recon_error"] = relative
        return relative
