"""LGC-PS: Learned Gradient Compression with a parameter server.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (2021), the
parameter-server variant, over torch.distributed: rank 0 is also the server (a gather to it, a
broadcast from it). :mod:`lgc.learned.state` runs the stages, :mod:`lgc.learned.knobs` declares the
common knobs. Per compressed step and bucket:

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

A rotating leader (``leaders.rotate``, the leader of step ``t`` is worker ``t % P``, as ScaleCom's
cyclic leader) changes only who encodes: that step's leader sends its message to the server point to
point (nothing travels when the server leads), and the server decodes it with the same decoders,
which were trained with a random worker's latent standing in for the leader's, so they expect any
worker's latent. Every worker therefore holds the encoder (its weights go to all of them once).
The leader is fixed by default (``leaders.rotate=False``, the server leads): every worker's own
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
``leaders.rotate``, to every worker). Upstream (worker -> server) and downstream (server's
broadcasts and weights, :attr:`~lgc.ddp.collectives.CommStats.server_bytes_sent`) bytes are
counted apart. The server runs in rank 0's process: the logical upstream bytes count rank 0's own
messages to it too (its innovation, and the leader's message when rank 0 leads), as a server of
its own would receive them, while the wire bytes (``wire_*``) count only what crosses the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lgc.autoencoder import num_chunks
from lgc.compressors.topk import to_wire_float
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.learned.knobs import CodecTrainingKnobs, LeaderChoice, Stages, knob_group
from lgc.learned.leader_code import LeaderIndexCodec
from lgc.learned.state import LGCHookState
from lgc.learned.step import Leaders, StepContext, latent_bytes, latent_wire_dtype, send_parameters
from lgc.learned.training import CodecTraining
from lgc.validation import Density, check

__all__ = ["LGCParameterServerState", "ParameterServerStage"]

_SERVER = 0
_HEADER = 3  # int64s before the downstream message: extra count and the byte lengths of both position codes


def check_innovation_density(innovation_density: float, density: float) -> float:
    if not 0.0 < float(innovation_density) < density:
        raise ValueError(
            f"innovation_density must be in (0, density={density}), got {innovation_density!r}: "
            "the innovation is the much sparser top-k that every worker sends besides the leader's code"
        )
    return float(innovation_density)


class ParameterServerStage:
    """LGC-PS's compressed stage: the leader's latent and every worker's innovation to a server, the sum back.

    Args:
        innovation_density: density of every worker's innovation top-k, below the leader's.
        latent_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` latents on the wire.
    """

    __slots__ = ("innovation_density", "latent_dtype", "wire_dtype")

    def __init__(self, innovation_density: float, latent_dtype: str = "float32") -> None:
        self.innovation_density = float(innovation_density)
        if latent_dtype == "int8":
            raise ValueError(
                "latent_dtype='int8' sums the workers' codes in shared 8-bit lanes, as LGC-RAR's allreduce does; "
                "LGC-PS's server receives every worker's own latent: use float32, float16 or bfloat16"
            )
        self.latent_dtype = latent_dtype
        self.wire_dtype = latent_wire_dtype(latent_dtype)

    def check_world(self, world_size: int) -> None:
        pass  # one decoder per worker, however many

    def distribute_weights(self, codec: torch.nn.Module, leaders: Leaders, stats: CommStats, group: Any) -> None:
        encoder = list(codec.encoder.parameters())
        if leaders.rotate:
            send_parameters(stats, encoder, None, group, as_server=True)
        elif leaders.rank != _SERVER:
            send_parameters(stats, encoder, leaders.rank, group, as_server=True)
        codec.eval()

    def _leader_wire(self, ctx: StepContext, v: Tensor) -> Tensor:
        code, plan = ctx.code, ctx.plan
        positions = code.in_wire_order(plan.top_positions(v), v)
        scales = code.chunk_scales(v[positions])
        latent = to_wire_float(ctx.codec.encode(code.scaled_chunks(v[positions], scales)), self.wire_dtype).reshape(-1)
        wire_positions = code.encode_positions(positions, plan.numel)
        return torch.cat([scales.view(torch.uint8), latent.view(torch.uint8), wire_positions])

    def _leader_to_server(self, ctx: StepContext, v: Tensor) -> Tensor | None:
        """The leader's message, at the server (None elsewhere)."""
        rank, leader, group, stats = ctx.rank, ctx.leader, ctx.group, ctx.stats
        wire = self._leader_wire(ctx, v) if rank == leader else None
        if leader == _SERVER:
            if wire is not None:
                counted.book_local_upstream(stats, wire)
            return wire
        if ctx.code.index_coding == "golomb":
            size = torch.tensor([0 if wire is None else wire.numel()], dtype=torch.int64, device=v.device)
            if rank == leader:
                counted.send(stats, size, _SERVER, group)
            elif rank == _SERVER:
                counted.recv(stats, size, leader, group)
            length = int(size.item())
        else:
            rows = num_chunks(ctx.plan.k, ctx.code.chunk)
            length = 4 * rows + latent_bytes(ctx.codec, rows, self.wire_dtype) + 4 * ctx.plan.k
        if rank == leader:
            assert wire is not None
            counted.send(stats, wire, _SERVER, group)
        elif rank == _SERVER:
            wire = counted.recv(stats, torch.empty(length, dtype=torch.uint8, device=v.device), leader, group)
        return wire

    def _serve(self, ctx: StepContext, leader_wire: Tensor, innovations: list[Tensor], k_innovation: int) -> Tensor:
        """At the server: decode every worker's values, sum, and build the downstream message."""
        plan, code, codec = ctx.plan, ctx.code, ctx.codec
        rows = num_chunks(plan.k, code.chunk)
        latent_size = latent_bytes(codec, rows, self.wire_dtype)
        scales = leader_wire[: 4 * rows].clone().view(torch.float32)
        latent = leader_wire[4 * rows : 4 * rows + latent_size].clone().view(self.wire_dtype)
        positions = code.decode_positions(leader_wire[4 * rows + latent_size :], plan.k)
        latent = latent.float().view(codec.latent_shape(rows))
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
            decoded = codec.decode(latent, code.scaled_chunks(innovation, scales), decoder=worker)
            estimate = code.unscaled(decoded, scales, plan.k)
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
        position_code = code.encode_positions(positions, plan.numel)
        extra_code = code.encode_positions(extras, plan.numel, ordered=False)
        header = torch.tensor([extras.numel(), position_code.numel(), extra_code.numel()], dtype=torch.int64)
        payload = torch.cat([at_leader, outside[extras], torch.tensor([relative], device=device)])
        return torch.cat([header.to(device).view(torch.uint8), position_code, extra_code, payload.view(torch.uint8)])

    def _parse_downstream(self, code: LeaderIndexCodec, wire: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, float]:
        header = wire[: 8 * _HEADER].clone().view(torch.int64).tolist()
        extra_count, position_bytes, extra_bytes = (int(h) for h in header)
        start = 8 * _HEADER
        positions = code.decode_positions(wire[start : start + position_bytes], k)
        start += position_bytes
        extras = code.decode_positions(wire[start : start + extra_bytes], extra_count, ordered=False)
        start += extra_bytes
        payload = wire[start:].clone().view(torch.float32)
        if payload.numel() != k + extra_count + 1:
            raise RuntimeError(f"corrupt LGC-PS downstream message: {payload.numel()} values for {k} + {extra_count}")
        return positions, extras, payload[: k + extra_count], float(payload[-1])

    @torch.no_grad()
    def run(self, ctx: StepContext) -> None:
        plan, group, stats = ctx.plan, ctx.group, ctx.stats
        if not plan.compressed:
            ctx.allreduce_dense([])
            return
        v = ctx.corrected()
        # This worker's innovation: its top-k at innovation_density per parameter, ascending.
        own_innovation = torch.sort(plan.top_positions(v, self.innovation_density)).values
        k_innovation = own_innovation.numel()
        innovation_wire = torch.cat(
            [v[own_innovation].float().view(torch.uint8), own_innovation.to(torch.int32).view(torch.uint8)]
        )
        ctx.mark_sent()
        leader_wire = self._leader_to_server(ctx, v)
        innovations = counted.gather(stats, innovation_wire, _SERVER, group)
        if ctx.rank == _SERVER:
            counted.book_local_upstream(stats, innovation_wire)
        ctx.count_payload()
        downstream = None
        if ctx.rank == _SERVER:
            assert leader_wire is not None and innovations is not None
            downstream = self._serve(ctx, leader_wire, innovations, k_innovation)
        downstream = counted.broadcast_bytes(stats, downstream, _SERVER, group, as_server=True)
        positions, extras, values, relative = self._parse_downstream(ctx.code, downstream, plan.k)

        ctx.measure_error(v[positions], values[: plan.k])
        ctx.apply(torch.cat([positions, extras]), values, like=v)
        v[positions] = 0.0
        v[own_innovation] = 0.0
        ctx.keep(v)
        if relative == relative:  # not NaN: some innovation fell on the leader's positions
            ctx.metrics["lgc/recon_error"] = relative
            ctx.schedule.record_error(relative, plan.k)
        ctx.allreduce_dense([])


#: LGC-PS's presets (lgc_ps.yaml's): LGC-RAR's stages and codec training, the server as the leader.
_STAGES = Stages()
_LEADERS = LeaderChoice(rotate=False)
_TRAINING = CodecTrainingKnobs()


class LGCParameterServerState(LGCHookState):
    """LGC-PS (``compressor=lgc_ps``): the leader's latent + every worker's innovation, via a server.

    The defaults are ``lgc/conf/compressor/lgc_ps.yaml``'s (LGC-RAR's stages and codec training,
    the server as the fixed leader, innovations 10x sparser than the leader's selection);
    ``lgc_ps_paper.yaml`` has the paper's.

    Args:
        density: top-k density of the leader's selection and of stage 2.
        innovation_density: density of every worker's innovation top-k, below ``density`` (the
            paper's is about 100x below). More innovation lets the decoders tell the workers apart
            better and sends exact values, at 8 bytes per entry.
        stages: the stages (:class:`~lgc.learned.knobs.Stages`, or a mapping of the fields to change).
        leaders: whose positions (:class:`~lgc.learned.knobs.LeaderChoice`): the server by default
            (see the module docstring).
        training: the autoencoder and its training (:class:`~lgc.learned.knobs.CodecTrainingKnobs`;
            one decoder per worker, with the innovation as an extra input; the autoencoder is the
            only codec, trained on the paper's top-k samples).
        latent_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` latents on the wire.
        measure_error, world_size, min_numel, process_group: as
            :class:`~lgc.learned.state.LGCHookState`'s.

    Example::

        >>> state = LGCParameterServerState(density=0.01, innovation_density=0.001, stages={"ae_steps": 50})
        >>> state.register(ddp_model)
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
        innovation_density: Density = 0.001,
        stages: Stages | Mapping[str, Any] = _STAGES,
        leaders: LeaderChoice | Mapping[str, Any] = _LEADERS,
        training: CodecTrainingKnobs | Mapping[str, Any] = _TRAINING,
        latent_dtype: Literal["float32", "float16", "bfloat16"] = "float32",
        measure_error: bool = False,
        world_size: int | None = None,
        min_numel: int | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        check("density", density, Density)
        innovation_density = check_innovation_density(innovation_density, density)
        knobs = knob_group(training, _TRAINING)
        if knobs.codec != "autoencoder":
            raise ValueError(
                f"training.codec={knobs.codec!r}: LGC-PS decodes every worker with its own decoder and "
                "innovation input, which only the autoencoder has; use training.codec=autoencoder"
            )
        super().__init__(
            ParameterServerStage(innovation_density, latent_dtype),
            CodecTraining(knobs, innovation_density=innovation_density),
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
        return self.learned_description(stage.latent_dtype)[:-1] + f", innovation_density={stage.innovation_density})"
