"""LGC-PS: Learned Gradient Compression with a parameter server.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (2021), the
parameter-server variant, over torch.distributed: rank 0 is also the server (a gather to it, a
broadcast from it). :mod:`lgc.ddp.lgc_base` has the stages and the common knobs. Per compressed
step and bucket:

1. Every worker forms ``v = residual + g`` (error feedback) and its *innovation*: a much sparser
   top-k of ``v`` (``innovation_density`` < ``density``) as fp32 values + int32 positions.
2. The leader also selects its top-k positions ``I`` and encodes its values there: it sends the
   server ``I`` (raw or Golomb-coded), its chunk scales and its latent code. Every worker,
   leader included, sends its innovation (one gather; the leader's own message is a point-to-point
   send, or nothing when the leader is the server).
3. The server has one decoder per worker: decoder ``i`` maps the leader's latent plus worker
   ``i``'s innovation (its values that fall on ``I``, as an extra input channel) to worker ``i``'s
   values at ``I``. Where the innovation knows a value exactly, the exact value replaces the
   estimate; innovation entries outside ``I`` are added as they are. The sum over workers (each
   already divided by the world size) is the averaged update.
4. The server broadcasts the update: ``I``, the extra innovation positions and their values.

A rotating leader (``rotate_leader``, the leader of step ``t`` is worker ``t % P``, as ScaleCom's
cyclic leader) changes only who encodes: that step's leader sends its message to the server point to
point (nothing travels when the server leads), and the server decodes it with the same decoders,
which were trained with a random worker's latent standing in for the leader's, so they expect any
worker's latent. Every worker therefore holds the encoder (its weights go to all of them once).
The leader is fixed by default (``rotate_leader=False``, the server leads): every worker's own
largest values already reach the server in its innovation, and a rotating leader's message costs
upload bytes that the server's own does not. On the 8-worker non-IID embedded task
(``experiments/lgc_rotation.sh``, one seed) rotating sent 2.5 % more bytes for a delivered-sum
error of 0.947 instead of 0.967, at the same accuracy.

Error feedback: a worker cannot see what the server reconstructed for it (that would cost
another download), so its residual is cleared at ``I`` and at its own innovation positions, as
if those values had been sent exactly; everything else stays in the residual.

The autoencoder (one encoder, one decoder per worker) is trained at the server on the samples of
stage 2, where every worker's values at the leader's positions and its innovation mask (one bit
per value) are gathered; the loss is reconstruction + the similarity of the workers' latents, a
random worker's latent standing in for the leader's in every sample. Then the encoder's weights
go to the leader (counted; nothing is sent when the leader is the server itself; with
``rotate_leader``, to every worker). Upstream (worker -> server) and downstream (server's
broadcasts and weights, :attr:`~lgc.ddp.collectives.CommStats.server_bytes_sent`) bytes are
counted apart. The server runs in rank 0's process: the logical upstream bytes count rank 0's own
messages to it too (its innovation, and the leader's message when rank 0 leads), as a server of
its own would receive them, while the wire bytes (``wire_*``) count only what crosses the network.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from typing import Any

import torch
from torch import Tensor

from lgc.autoencoder import AutoencoderConfig, num_chunks
from lgc.coding import unpack_bits
from lgc.compressors.topk import num_selected, topk_indices
from lgc.ddp import collectives as counted
from lgc.ddp.lgc_base import LGCHookState, StepPlan

__all__ = ["LGCParameterServerState"]

_SERVER = 0
_HEADER = 3  # int64s before the downstream message: extra count and the byte lengths of both position codes


class LGCParameterServerState(LGCHookState):
    """LGC-PS (``compressor=lgc_ps``): the leader's latent + every worker's innovation, via a server.

    Args:
        innovation_density: density of every worker's innovation top-k, below ``density`` (the
            paper's is about 100x below). More innovation lets the decoders tell the workers apart
            better and sends exact values, at 8 bytes per entry.
        **kwargs: the stages and common knobs of :class:`~lgc.ddp.lgc_base.LGCHookState`.

    Example::

        >>> state = LGCParameterServerState(density=0.01, innovation_density=0.001, warmup_steps=20, ae_steps=50)
        >>> state.register(ddp_model)
    """

    has_server = True

    __slots__ = ("innovation_density",)

    def __init__(self, *, innovation_density: float = 0.0001, **kwargs: Any) -> None:
        density = float(kwargs.get("density", 0.001))
        if not 0.0 < float(innovation_density) < density:
            raise ValueError(
                f"innovation_density must be in (0, density={density}), got {innovation_density!r}: "
                "the innovation is the much sparser top-k that every worker sends besides the leader's code"
            )
        self.innovation_density = float(innovation_density)
        super().__init__(**kwargs)

    def _autoencoder_config(self, config: AutoencoderConfig, world_size: int | None) -> AutoencoderConfig:
        return AutoencoderConfig(**{**vars(config), "num_decoders": world_size or 1, "innovation": True})

    def describe(self) -> str:
        return super().describe()[:-1] + f", innovation_density={self.innovation_density})"

    def _distribute_weights(self) -> None:
        encoder = list(self.autoencoder.encoder.parameters())
        if self.rotate_leader:
            self._send_flat_parameters(encoder, None)
        elif self.leader_rank != _SERVER:
            self._send_flat_parameters(encoder, self.leader_rank)
        self.autoencoder.eval()

    def _innovation_positions(self, plan: StepPlan, v: Tensor) -> Tensor:
        """This worker's innovation: its top-k at ``innovation_density`` per parameter, ascending."""
        return torch.sort(plan.top_positions(v, self.innovation_density)).values

    def _innovation_k(self, numel: int) -> int:
        return num_selected(numel, self.innovation_density)

    # -- stage 2: the innovation mask travels with the samples ------------------------------------
    def _innovation_of(self, v: Tensor, positions: Tensor) -> Tensor | None:
        return torch.isin(positions, topk_indices(v, self._innovation_k(v.numel())))

    def _add_samples(self, chunks: Tensor, innovation_masks: list[Tensor] | None, k: int) -> None:
        assert self.trainer is not None and innovation_masks is not None
        masks = torch.stack(
            [self.leader_code.chunks(unpack_bits(m.cpu(), k).float()) for m in innovation_masks], dim=1
        ).to(chunks.device)
        innovations = chunks * masks
        self._record_held_out(self.trainer.evaluate(chunks, innovations) if self.trainer.num_samples else None)
        self.trainer.add(chunks, innovations)

    # -- stage 3 ----------------------------------------------------------------------------------
    def _leader_wire(self, plan: StepPlan, v: Tensor) -> Tensor:
        positions = self.leader_code.in_wire_order(plan.top_positions(v), v)
        scales = self.leader_code.chunk_scales(v[positions])
        latent = self._wire_latent(self.autoencoder.encode(self.leader_code.scaled_chunks(v[positions], scales)))
        code = self.leader_code.encode_positions(positions, plan.numel)
        return torch.cat([scales.view(torch.uint8), latent.view(torch.uint8), code])

    def _leader_to_server(self, plan: StepPlan, v: Tensor) -> Tensor | None:
        """The leader's message, at the server (None elsewhere)."""
        wire = self._leader_wire(plan, v) if self.rank == self.leader else None
        if self.leader == _SERVER:
            if wire is not None:
                counted.book_local_upstream(self.stats, wire)
            return wire
        group = self.process_group
        if self.index_coding == "golomb":
            size = torch.tensor([0 if wire is None else wire.numel()], dtype=torch.int64, device=v.device)
            if self.rank == self.leader:
                counted.send(self.stats, size, _SERVER, group)
            elif self.rank == _SERVER:
                counted.recv(self.stats, size, self.leader, group)
            length = int(size.item())
        else:
            rows = num_chunks(plan.k, self.ae_config.chunk)
            length = 4 * rows + self._latent_bytes(rows) + 4 * plan.k
        if self.rank == self.leader:
            assert wire is not None
            counted.send(self.stats, wire, _SERVER, group)
        elif self.rank == _SERVER:
            wire = counted.recv(self.stats, torch.empty(length, dtype=torch.uint8, device=v.device), self.leader, group)
        return wire

    def _serve(self, plan: StepPlan, leader_wire: Tensor, innovations: list[Tensor], k_innovation: int) -> Tensor:
        """At the server: decode every worker's values, sum, and build the downstream message."""
        rows = num_chunks(plan.k, self.ae_config.chunk)
        latent_size = self._latent_bytes(rows)
        scales = leader_wire[: 4 * rows].clone().view(torch.float32)
        latent = leader_wire[4 * rows : 4 * rows + latent_size].clone().view(self.latent_torch_dtype)
        positions = self.leader_code.decode_positions(leader_wire[4 * rows + latent_size :], plan.k)
        latent = latent.float().view(self.autoencoder.latent_shape(rows))
        device = scales.device
        slot = torch.full((plan.numel,), -1, dtype=torch.long, device=device)
        slot[positions] = torch.arange(plan.k, device=device)
        at_leader = torch.zeros(plan.k, device=device)
        outside = torch.zeros(plan.numel, device=device)
        outside_hit = torch.zeros(plan.numel, dtype=torch.bool, device=device)
        error, norm = 0.0, 0.0
        for worker, wire in enumerate(innovations):
            values = wire[: 4 * k_innovation].clone().view(torch.float32)
            where = wire[4 * k_innovation :].clone().view(torch.int32).long()
            slots = slot[where]
            inside = slots >= 0
            innovation = torch.zeros(plan.k, device=device)
            innovation[slots[inside]] = values[inside]
            decoded = self.autoencoder.decode(
                latent, self.leader_code.scaled_chunks(innovation, scales), decoder=worker
            )
            estimate = self.leader_code.unscaled(decoded, scales, plan.k)
            known = slots[inside]
            error += float((estimate[known] - values[inside]).square().sum())
            norm += float(values[inside].square().sum())
            # Where the innovation knows the value, it replaces the estimate; outside I it adds.
            estimate[known] = values[inside]
            at_leader += estimate
            outside.index_add_(0, where[~inside], values[~inside])
            outside_hit[where[~inside]] = True
        extras = torch.nonzero(outside_hit).view(-1)
        relative = error / norm if norm > 0 else float("nan")
        position_code = self.leader_code.encode_positions(positions, plan.numel)
        extra_code = self.leader_code.encode_positions(extras, plan.numel, ordered=False)
        header = torch.tensor([extras.numel(), position_code.numel(), extra_code.numel()], dtype=torch.int64)
        payload = torch.cat([at_leader, outside[extras], torch.tensor([relative], device=device)])
        return torch.cat([header.to(device).view(torch.uint8), position_code, extra_code, payload.view(torch.uint8)])

    def _parse_downstream(self, wire: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, float]:
        header = wire[: 8 * _HEADER].clone().view(torch.int64).tolist()
        extra_count, position_bytes, extra_bytes = (int(h) for h in header)
        start = 8 * _HEADER
        positions = self.leader_code.decode_positions(wire[start : start + position_bytes], k)
        start += position_bytes
        extras = self.leader_code.decode_positions(wire[start : start + extra_bytes], extra_count, ordered=False)
        start += extra_bytes
        payload = wire[start:].clone().view(torch.float32)
        if payload.numel() != k + extra_count + 1:
            raise RuntimeError(f"corrupt LGC-PS downstream message: {payload.numel()} values for {k} + {extra_count}")
        return positions, extras, payload[: k + extra_count], float(payload[-1])

    @torch.no_grad()
    def _compressed_step(self, plan: StepPlan) -> None:
        group = self.process_group
        if not plan.compressed:
            self._allreduce_dense(plan, [])
            return
        v = plan.corrected(self.ef.residuals)
        own_innovation = self._innovation_positions(plan, v)
        k_innovation = own_innovation.numel()
        innovation_wire = torch.cat(
            [v[own_innovation].float().view(torch.uint8), own_innovation.to(torch.int32).view(torch.uint8)]
        )
        sent_before = self.stats.bytes_sent
        leader_wire = self._leader_to_server(plan, v)
        innovations = counted.gather(self.stats, innovation_wire, _SERVER, group)
        if self.rank == _SERVER:
            counted.book_local_upstream(self.stats, innovation_wire)
        self._count_payload(self.stats.bytes_sent - sent_before, plan)
        downstream = None
        if self.rank == _SERVER:
            assert leader_wire is not None and innovations is not None
            downstream = self._serve(plan, leader_wire, innovations, k_innovation)
        downstream = counted.broadcast_bytes(self.stats, downstream, _SERVER, group, as_server=True)
        positions, extras, values, relative = self._parse_downstream(downstream, plan.k)

        self._measure_error(v[positions], values[: plan.k])
        update = torch.zeros(plan.numel, dtype=v.dtype, device=v.device)
        update[torch.cat([positions, extras])] = values.to(v.dtype)
        plan.scatter(update)
        v[positions] = 0.0
        v[own_innovation] = 0.0
        plan.keep_residuals(self.ef.residuals, v)
        if relative == relative:  # not NaN: some innovation fell on the leader's positions
            self.last_metrics["lgc/recon_error"] = relative
            self.step_error[0] += relative * plan.k
            self.step_error[1] += plan.k
        self._allreduce_dense(plan, [])
