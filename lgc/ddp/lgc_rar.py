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

Bytes per worker and bucket: the latent (``K / 4`` floats by default, or half that in fp16), the
dense small parameters, and the leader's broadcast (``4 K`` bytes raw, about ``1.4 K`` Golomb-coded
at density 0.001, plus the scales). With ``refresh_threshold`` set, each worker's reconstruction
error rides along in the allreduce (4 bytes), so all workers decide a refresh alike.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lgc.autoencoder import AutoencoderConfig, chunk_scales, num_chunks, to_chunks
from lgc.ddp import collectives as counted
from lgc.ddp.lgc_base import LGCHookState, StepPlan

__all__ = ["LGCRingAllreduceState"]

_RESIDUALS = ("own_reconstruction", "zero")


class LGCRingAllreduceState(LGCHookState):
    """LGC-RAR (``compressor=lgc_rar``): workers sum autoencoder latents with an allreduce.

    Args:
        residual: ``"own_reconstruction"`` keeps what this worker's own latent does not carry;
            ``"zero"`` clears the residual at the leader's positions.
        **kwargs: the stages and common knobs of :class:`~lgc.ddp.lgc_base.LGCHookState`.

    Example::

        >>> state = LGCRingAllreduceState(density=0.01, warmup_steps=20, ae_steps=50)
        >>> state.register(ddp_model)  # then train as usual; state.metrics()["lgc/stage"] tells the stage
    """

    __slots__ = ("residual",)

    def __init__(self, *, residual: str = "own_reconstruction", **kwargs: Any) -> None:
        if residual not in _RESIDUALS:
            raise ValueError(f"residual must be one of {_RESIDUALS}, got {residual!r}")
        super().__init__(**kwargs)
        self.residual = residual

    def _autoencoder_config(self, config: AutoencoderConfig, world_size: int | None) -> AutoencoderConfig:
        return AutoencoderConfig(**{**vars(config), "num_decoders": 1, "innovation": False})

    def _distribute_weights(self) -> None:
        # Only rank 0 trained; every worker encodes and decodes, so everyone gets everything.
        self._send_flat_parameters(list(self.autoencoder.parameters()), None)
        self.autoencoder.eval()

    def _leader_message(self, plan: StepPlan, v: Tensor) -> tuple[Tensor, Tensor]:
        """Broadcast the leader's positions and chunk scales; returns them on every rank."""
        rows = num_chunks(plan.k, self.ae_config.chunk)
        scale_bytes = 4 * rows
        wire = None
        if self.rank == self.leader:
            positions = self._leader_positions(plan, v)
            scales = chunk_scales(to_chunks(v[positions], self.ae_config.chunk))
            wire = torch.cat([scales.view(torch.uint8), self._encode_positions(positions, plan.numel)])
        if self.index_coding == "golomb":
            wire = counted.broadcast_bytes(self.stats, wire, self.leader, self.process_group)
        else:
            if wire is None:
                wire = torch.empty(scale_bytes + 4 * plan.k, dtype=torch.uint8, device=v.device)
            counted.broadcast(self.stats, wire, self.leader, self.process_group)
        scales = wire[:scale_bytes].clone().view(torch.float32)
        return self._decode_positions(wire[scale_bytes:], plan.k), scales

    @torch.no_grad()
    def _compressed_step(self, plan: StepPlan) -> None:
        world_size = dist.get_world_size(self.process_group)
        refresh = self.refresh_threshold is not None
        if not plan.compressed:
            self._allreduce_dense(plan, [])
            return
        ae = self.autoencoder
        v = self._corrected(plan)
        sent_before = self.stats.bytes_sent
        positions, scales = self._leader_message(plan, v)
        values = v[positions]
        latent = self._wire_latent(ae.encode(self._scaled_chunks(values, scales)))
        self._count_payload(self.stats.bytes_sent - sent_before + counted.nbytes(latent), plan)
        rows = scales.numel()
        own = self._unscaled(ae.decode(latent.float().view(self._latent_shape(rows))), scales, plan.k)
        error, norm = float((values - own).square().sum()), float(values.square().sum())
        relative = error / norm if norm > 0 else 0.0
        self.last_metrics["lgc/recon_error"] = relative
        v[positions] = values - own if self.residual == "own_reconstruction" else 0.0
        self._keep_residuals(plan, v)

        # The latent rides with the dense parameters in one allreduce when it is fp32, else its own.
        error_part = [v.new_tensor([relative])] if refresh else []
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
        mean_latent = (latent_sum / world_size).view(self._latent_shape(rows))
        mean_values = self._unscaled(ae.decode(mean_latent), scales, plan.k)
        update = torch.zeros(plan.numel, dtype=v.dtype, device=v.device)
        # Each worker's share is already divided by the world size: the sum is the mean gradient.
        update[positions] = (mean_values * world_size).to(v.dtype)
        plan.scatter(update)
