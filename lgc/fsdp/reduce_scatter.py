"""A compressed gradient reduce-scatter for FSDP2 (``fully_shard``): every lgc compressor, sharded.

FSDP2 reduces each parameter group's gradients in one reduce-scatter and lets a program replace it
(``FSDPModule.set_custom_reduce_scatter``). :class:`CompressedReduceScatter` is that replacement;
:class:`FSDPCompression` runs it for one model with the DDP hook's state
(:class:`~lgc.ddp.CompressionHookState`: compressor, step guard, statistics, checkpoints). For a
parameter group:

1. Parameters below ``min_numel`` (biases, norm layers) are summed dense in one all-reduce of their
   concatenation, as the DDP hook sums them (divided by the world size; transformed first where the
   compressor holds dense state, as DGC's momentum).
2. Every other parameter's gradient is rebuilt whole from the reduce-scatter input
   (:class:`~lgc.fsdp.layout.GroupLayout`) and compressed on its own, keyed by the parameter's
   name, exactly as the DDP hook compresses it: the compressor selects on the full unsharded
   gradient (top-k's largest entries of the whole tensor, not of a shard), so residuals, momenta
   and payloads are those of the DDP hook and a compressed FSDP2 run follows the DDP run's
   trajectory. The payloads are exchanged as the compressor declares (gathered: an allgather;
   summable: an allreduce; :mod:`lgc.ddp.exchange`), every rank decodes the sum, and keeps the
   chunk it owns. The cost of selecting on the whole gradient: error feedback's residual (DGC's
   momentum and accumulator) is a full-size fp32 tensor per compressed parameter on every rank,
   not a shard of one.
   The quantizers (:func:`codes_shards`: fp16, fp4, QSGD, TernGrad, EF-signSGD) need no whole
   gradient, since they code every entry: each rank codes each chunk of the gradient on its own
   (keyed ``name@chunk``: its own scale, rounding and residual) and sends it only to the chunk's
   owner in one all-to-all, which decodes every rank's codes and sums them in fp32. A rank then
   sends ``(P - 1) / P`` of its coded gradient, as NCCL's ring reduce-scatter does of a dense one
   (gloo runs a dense reduce-scatter as an all-reduce: twice that).
3. The step guard decides each group before its state moves: one small allreduce says whether
   some rank has an inf or NaN in the group (then it is reduce-scattered dense and unchanged, as
   stock FSDP2 does), which parameters have a gradient on some rank, and whether the ranks carry
   the same parameters (else every rank refuses, naming them, before a mismatched collective). A compressor with state
   encodes into held state (:class:`~lgc.compressors.base.HoldsSteps`); at the end of the backward
   pass the step is committed, or dropped whole if any group of it was skipped, so a skipped step
   leaves every residual as it was, as under DDP. Stateless compressors need no guard, but the
   quantizers take it, so that every rank skips the same steps although each sums other chunks.

``none`` never reaches a compressor: every group is reduce-scattered as stock FSDP2 does it, bit for
bit, and counted. The collectives are issued inside FSDP2's reduce-scatter call, in group order,
the same on every rank.

**Hybrid sharding (HSDP).** FSDP2's own HSDP (a 2-D mesh) all-reduces the replicas dense before any
hook sees the gradient. lgc's hybrid form shards the model over the shard dimension only
(``fully_shard(mesh=mesh["shard"])``) and is given the replicate dimension
(``lgc.compress(..., replicate=mesh["replicate"])``): FSDP2's reduce-scatter inside a replica stays
exact (the fast links), and the all-reduce across replicas (the slow ones) is lgc's, compressed, in
FSDP2's all-reduce hook (``set_all_reduce_hook``). There each rank holds its shard of its replica's
summed gradient; the compressor runs on every parameter's shard, keyed by its name (top-k selects
among the shard, residuals are shard-sized), and the replicas holding the same shard exchange
payloads, as DDP workers would; a tiled compressor (chunked top-k, SparseLoCo's selection, DeMo)
tiles the shard's rows, where under DDP it tiles the whole parameter's (the same tiles wherever a
shard's first row starts a tile). The step guard decides over the whole world, so every rank skips
or commits the same steps. ``state.stats`` counts the replicate dimension's traffic.

Why one module: the reduce-scatter FSDP2 calls and the per-step bookkeeping it feeds (the end of a
backward pass, the held step's commit) are one unit; the layout arithmetic is in ``layout``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from lgc.compressors.base import CombineMode, HoldsSteps, holds_steps
from lgc.compressors.dgc import DGCCompressor
from lgc.compressors.none import NoneCompressor
from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.exchange import PayloadExchange, Segment, average_compressed, prepare_compressor
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.step_guard import StepVerdict, agree_flags, bucket_maxima
from lgc.fsdp.layout import GroupLayout

__all__ = [
    "CompressedReduceScatter",
    "FSDPCompression",
    "broadcast_from_first_replica",
    "check_fsdp_state",
    "check_replicate",
    "codes_shards",
    "fsdp_modules",
    "guard_flags",
    "param_groups",
    "read_guard_flags",
]


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` that ``fully_shard`` made an FSDP module, ``model`` (the root) first."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def check_fsdp_state(state: Any, method: Any) -> CompressionHookState:
    """Refuse a hook state FSDP2's reduce-scatter cannot run, naming it; return it as a compression state."""
    if type(state) is not CompressionHookState:
        raise ValueError(
            f"lgc.compress on an FSDP2 model runs an lgc compressor every step (e.g. 'topk', 'dgc', 'sbc', 'qsgd', "
            f"'fp16'), LGC's family across replicas and the local-step family; {method!r} builds "
            f"{type(state).__name__}, which runs collectives of its own (PyTorch's DDP hooks): use it with "
            "DistributedDataParallel"
        )
    compressor = state.compressor
    if compressor.combine is CombineMode.SERVER:
        raise ValueError(f"{compressor!r} combines via a server, which FSDP2's reduce-scatter does not run")
    if not compressor.stateless and not holds_steps(compressor):
        raise ValueError(
            f"{compressor!r} keeps state that it cannot hold back until every parameter group of a step is "
            "decided (HoldsSteps); under FSDP2 a step is reduced group by group, so a skipped step could not leave "
            "its state as it was: use it with DistributedDataParallel"
        )
    if getattr(compressor, "weight_decay", 0.0) and isinstance(compressor, DGCCompressor):
        raise ValueError(
            f"DGC's weight_decay={compressor.weight_decay:g} adds the decay of every parameter whole on every rank, "
            "which FSDP2 shards: give the decay to the optimizer under FSDP2 (lgc.compress(model, 'dgc', "
            "weight_decay=0, ...) with torch.optim.SGD(..., weight_decay=wd); lgc-train: compressor.weight_decay=0 "
            "optimizer.weight_decay=wd)"
        )
    if state.overlap:
        raise ValueError("overlap=True is a DDP hook setting: FSDP2 reduces each parameter group as it is ready")
    return state


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter for one parameter group, through an :class:`FSDPCompression`.

    It learns which of the group's parameters the reduce-scatter carries from the group's
    ``post_backward`` (wrapped by :meth:`watch`), which FSDP2 calls just before: those with a
    gradient (or an accumulated one), and with ``set_reduce_scatter_unused_params`` every parameter
    that takes one, exactly FSDP2's own choice. A parameter without a gradient on every rank is then
    left out as stock FSDP2 leaves it out (its ``.grad`` stays None).
    """

    def __init__(self, compression: FSDPCompression, param_group: Any, names: dict[int, str], world: int) -> None:
        self.compression = compression
        self.param_group = param_group
        self.names = names
        self.world = world
        #: Every parameter of the group that takes a gradient, in the group's order (the step guard's flags).
        self.all_names = tuple(
            names[id(p.sharded_param)] for p in param_group.fsdp_params if p.sharded_param.requires_grad
        )
        #: Each of :attr:`all_names`' place in the step guard's flags.
        self.flag_index = {name: i for i, name in enumerate(self.all_names)}
        #: The parameters (``(name, shape)``) the next reduce-scatter carries, as post_backward chose them.
        self.carried: tuple[tuple[str, tuple[int, ...]], ...] = ()
        self.layouts: dict[tuple[tuple[str, tuple[int, ...]], ...], GroupLayout] = {}

    def watch(self) -> None:
        """Wrap the group's ``post_backward`` to note the parameters its reduce-scatter will carry."""
        group, original = self.param_group, self.param_group.post_backward

        def post_backward(*args: Any) -> Any:
            self.carried = tuple(
                (self.names[id(p.sharded_param)], tuple(p._orig_size))
                for p in group.fsdp_params
                if _reduced(p, group.reduce_scatter_unused_params)
            )
            return original(*args)

        group.post_backward = post_backward

    def layout(self, min_numel: int) -> GroupLayout:
        """The layout of the parameters the current reduce-scatter carries (one per distinct set, kept)."""
        layout = self.layouts.get(self.carried)
        if layout is None:
            layout = self.layouts[self.carried] = GroupLayout(self.carried, self.world, min_numel)
        return layout

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any, async_op: bool = False
    ) -> None:
        if async_op:
            raise NotImplementedError("lgc's compressed reduce-scatter runs synchronously (FSDP2 never asks otherwise)")
        self.compression.reduce_scatter(self, output_tensor, input_tensor, group, op)


def _reduced(fsdp_param: Any, unused_too: bool) -> bool:
    """Whether FSDP2's ``post_backward`` puts ``fsdp_param`` in its reduce-scatter (its own test, in its order)."""
    if not hasattr(fsdp_param, "_unsharded_param"):
        return False
    unsharded = fsdp_param._unsharded_param
    if fsdp_param.unsharded_accumulated_grad is not None or unsharded.grad is not None:
        return True
    return bool(unused_too and unsharded.requires_grad)


class FSDPCompression:
    """The compressed gradient reduction of one FSDP2 model, with ``state``'s compressor and statistics.

    Built by :func:`lgc.compress` for an FSDP2 model; :meth:`register` installs a
    :class:`CompressedReduceScatter` on every FSDP module of the model. ``state.iteration`` counts
    finished steps (a backward pass that reduced, not skipped), as under DDP.
    """

    def __init__(
        self, state: CompressionHookState, replicate: dist.ProcessGroup | None = None, buffers: str | None = None
    ) -> None:
        if buffers is not None:
            module_buffers.check_buffer_mode(buffers)
        self.state = state
        #: Module buffers kept in step once per step (``broadcast`` from rank 0, or ``average``), as lgc's DDP
        #: hook keeps them; None leaves each rank its own, as FSDP2 does.
        self.buffers = buffers
        self._buffer_names: tuple[str, ...] = ()
        self._model: torch.nn.Module | None = None
        #: HSDP's replicate dimension, whose all-reduce lgc compresses; None: the reduce-scatter is compressed.
        self.replicate = replicate
        #: The group the step guard decides over (the shard group, or with ``replicate`` the world).
        self.guard_group: dist.ProcessGroup | None = None
        #: Whether the current backward pass has reduced a group (its end is then queued).
        self.in_step = False
        #: Whether some group of the current step was skipped (inf/NaN on some rank).
        self.step_skipped = False
        #: Parameters with a gradient on some rank in the current step (held state committed for them).
        self.used: set[str] = set()
        #: Whether the current step compresses (past ``start_iter``).
        self.compressing = False
        #: The reduce-scatters installed, one per parameter group.
        self.comms: list[CompressedReduceScatter] = []

    @property
    def dense_only(self) -> bool:
        """Whether nothing is compressed (``none``): every group goes as stock FSDP2's reduce-scatter."""
        return isinstance(self.state.compressor, NoneCompressor)

    def register(self, model: torch.nn.Module) -> None:
        """Install the compressed reduce-scatter on every FSDP module of ``model`` (the root of ``fully_shard``).

        Everything is checked before anything is installed: one mesh of at least two ranks (with
        ``replicate``: replicas times shards is the world, at least two replicas), no 2-D mesh
        (FSDP2's own HSDP), one parameter group per module, gradients sharded on dim 0. With
        ``replicate``, every parameter shard is broadcast from the first replica, as DDP broadcasts
        its parameters at construction.
        """
        state = self.state
        names = {id(p): name for name, p in model.named_parameters()}
        groups, shard_pg = param_groups(model)
        world = dist.get_world_size(shard_pg)
        if self.replicate is not None:
            check_replicate(self.replicate, shard_pg)
        elif world < 2:
            raise ValueError(
                "FSDP2 on one rank reduces nothing (it never calls a reduce-scatter), so lgc would compress nothing: "
                "run on two or more ranks"
            )
        for module, param_group in groups:
            comm = CompressedReduceScatter(self, param_group, names, world)
            comm.watch()
            if self.replicate is None:
                module.set_custom_reduce_scatter(comm)
            else:
                module.set_all_reduce_hook(functools.partial(self.all_reduce, comm))
            self.comms.append(comm)
        model.register_forward_pre_hook(self._before_forward)
        if self.buffers is not None:
            self._model = model
            self._buffer_names = tuple(name for name, _ in model.named_buffers())
        state.buffer_sync = module_buffers.BufferSync(
            self.buffers if self._buffer_names else module_buffers.NO_SYNC, self._buffer_names
        )
        if self.replicate is None:
            state.process_group = self.guard_group = shard_pg
        else:
            state.process_group, self.guard_group = self.replicate, dist.group.WORLD
            broadcast_from_first_replica(model, self.replicate)
        params = dict(model.named_parameters())
        if self.replicate is not None:
            # Each rank codes its shard of each parameter: a tiled compressor tiles the shard's rows.
            params = {name: p.to_local() if isinstance(p, DTensor) else p for name, p in params.items()}
        state.compressor.attach_parameters(params)

    # -- one group ---------------------------------------------------------------------------------
    def reduce_scatter(self, comm: CompressedReduceScatter, output: Tensor, input: Tensor, group: Any, op: Any) -> None:
        """Reduce-scatter ``input`` (``world x row``) into ``output`` (this rank's row) with ``state``'s compressor."""
        state = self.state
        if group is not state.process_group:
            raise RuntimeError(
                "FSDP2 reduce-scattered over a process group other than its mesh's "
                "(set_separate_reduce_scatter_group?): lgc compresses over the mesh's shard group"
            )
        if not self.in_step:
            self._begin_step()
        state.stats.hook_calls += 1
        counted.book_dense_reduce_scatter(state.stats, input, group)
        if self.dense_only or not self.compressing:
            self._as_stock(input, output, group, op)
            if self.dense_only:  # counted as the DDP hook counts a stateless method's non-finite step
                state.skips.note(state.stats, state.iteration, output)
            return
        layout = comm.layout(state.min_numel)
        layout.check(input.numel(), output.numel())
        world = layout.world
        buffer = input.new_empty(layout.unsharded_numel())
        segments = layout.gather_unsharded(input.view(world, layout.row), buffer)
        # As the DDP hook: each worker's share, divided by the world size (FSDP2's fp16 reductions have
        # divided it already, and sum; set_gradient_divide_factor's factor) and by the loss scale.
        state.unscale(buffer, _divisor(op, world, comm.param_group.gradient_divide_factor))
        shards = codes_shards(state.compressor)
        if state.guards_steps or shards:
            verdict = self._agree(comm, buffer, segments)
            if verdict.skip:
                self.step_skipped = True
                self._as_stock(input, output, group, op)
                return
            self.used |= verdict.used
            if shards:
                self._exchange_shards(layout, buffer, segments, verdict.used, dist.get_rank(group))
            else:
                self._exchange_held(buffer, segments, verdict.used)
        else:
            result = average_compressed(state, buffer, segments, state.iteration).wait()
            state.skips.note(state.stats, state.iteration, result)
        if state.step_scale != 1.0:
            buffer.mul_(state.step_scale)
        layout.scatter_own(buffer, output, dist.get_rank(group))

    def all_reduce(self, comm: CompressedReduceScatter, reduced: Tensor) -> None:
        """HSDP's all-reduce across replicas of ``reduced`` (this rank's shard of its replica's sum), compressed.

        Run by FSDP2's all-reduce hook after the exact reduce-scatter inside the replica, before
        FSDP2's own post-division; leaves the replicas' average in ``reduced``, as FSDP2's HSDP does.
        """
        state = self.state
        replicas = self._open_all_reduce(comm, reduced)
        if self.dense_only or not self.compressing:
            self._average_dense(reduced, replicas)
            if self.dense_only:  # counted as the DDP hook counts a stateless method's non-finite step
                state.skips.note(state.stats, state.iteration, reduced)
            return
        shards = self._shard_segments(comm, reduced)
        held = tuple(s for s in shards if s.numel)
        if state.guards_steps:
            verdict = self._agree(comm, reduced, shards)
            if verdict.skip:
                self.step_skipped = True
                self._average_dense(reduced, replicas)
                return
            self.used |= verdict.used
            state.unscale(reduced, replicas)
            self._exchange_held(reduced, held, verdict.used)
        else:
            state.unscale(reduced, replicas)
            result = average_compressed(state, reduced, held, state.iteration).wait()
            state.skips.note(state.stats, state.iteration, result)
        if state.step_scale != 1.0:
            reduced.mul_(state.step_scale)

    def _open_all_reduce(self, comm: CompressedReduceScatter, reduced: Tensor) -> int:
        """The start of every all-reduce hook call: the step opened at its first group, the call and what plain
        HSDP would send counted. Returns what the replicas' sum is divided by."""
        if not self.in_step:
            self._begin_step()
        self.state.stats.hook_calls += 1
        counted.book_dense_equivalent(self.state.stats, reduced, self.replicate)
        # FSDP2 divided the replica's sum by the shard count (AVG), or by set_gradient_divide_factor's factor,
        # which is the whole run's: then the replicas' results are summed, not averaged.
        if comm.param_group.gradient_divide_factor is not None:
            return 1
        return dist.get_world_size(self.replicate)

    def _shard_segments(self, comm: CompressedReduceScatter, reduced: Tensor) -> tuple[Segment, ...]:
        """Every parameter ``reduced`` carries, this rank's shard of it (empty where it holds padding only)."""
        layout = comm.layout(self.state.min_numel)
        layout.check(layout.world * reduced.numel(), reduced.numel())
        return layout.own_segments(dist.get_rank(comm.param_group.mesh_info.shard_process_group))

    def _average_dense(self, reduced: Tensor, replicas: int) -> None:
        """FSDP2's own HSDP all-reduce (the replicas' average), counted."""
        counted.all_reduce(self.state.stats, reduced, self.replicate).wait()
        reduced.div_(replicas)

    def _agree(self, comm: CompressedReduceScatter, buffer: Tensor, segments: tuple[Segment, ...]) -> StepVerdict:
        """The step guard's allreduce for one group, over every parameter the group could carry.

        One MAX-allreduce of ``1 + 3 n`` bytes (``n`` parameters that take a gradient): inf/NaN
        anywhere, and per parameter whether its gradient is nonzero, carried, and left out on some
        rank. Its length never depends on what a rank carries, so ranks that carry different
        parameters (one used on some ranks only, without ``set_reduce_scatter_unused_params``: stock
        FSDP2's reduce-scatters would not match either) learn it here, and every rank refuses.
        """
        # On the gradients' device: NCCL reduces device tensors only.
        flags = agree_flags(self.state.stats, guard_flags(comm, buffer, segments).to(buffer.device), self.guard_group)
        return read_guard_flags(comm, flags)

    def _exchange_held(self, buffer: Tensor, segments: tuple[Segment, ...], used: frozenset[str]) -> None:
        """A guarded group's exchange, the state it moves held until the step's end (:meth:`_end_step`).

        The dense parameters used on some rank are transformed as the compressor holds them (DGC's
        momentum) and summed in one allreduce, as the DDP hook sums them; the compressed ones are
        encoded into held state and exchanged (:class:`~lgc.ddp.exchange.PayloadExchange`). A
        parameter unused on every rank keeps its zero and moves no state.
        """
        state = self.state
        compressor = state.compressor
        assert isinstance(compressor, HoldsSteps), compressor
        # Rank, world size, shared seed and the step's schedule (DGC's warm-up) before anything encodes.
        prepare_compressor(state, buffer.device, state.iteration)
        self._sum_dense(buffer, segments, used)
        compressed = tuple(s for s in segments if s.compressed and s.name in used)
        if compressed:
            exchange = PayloadExchange(state, buffer, compressed, state.iteration, pending=True)
            torch.futures.wait_all(exchange.futures)
            exchange.finish()

    def _sum_dense(self, buffer: Tensor, segments: tuple[Segment, ...], used: frozenset[str]) -> None:
        """The dense parameters used on some rank, transformed as the compressor holds them (DGC's momentum) and
        summed in one allreduce, as the DDP hook sums them."""
        state, compressor = self.state, self.state.compressor
        dense = [s for s in segments if not s.compressed and s.name in used]
        if not dense:
            return
        pieces = [buffer[s.offset : s.offset + s.numel] for s in dense]
        if compressor.transforms_dense:
            assert isinstance(compressor, HoldsSteps), compressor
            for s, piece in zip(dense, pieces, strict=True):
                piece.copy_(compressor.transform_dense_pending(piece, s.name))
        summed = torch.cat(pieces)
        counted.all_reduce(state.stats, summed, state.process_group).wait()
        for s, piece, total in zip(dense, pieces, summed.split([s.numel for s in dense]), strict=True):
            piece.copy_(total)
            compressor.finish_aggregate(piece, s.name)
            state.layer_stats.book(s.name, s.numel, False, s.numel * buffer.element_size())

    def _exchange_shards(
        self, layout: GroupLayout, buffer: Tensor, segments: tuple[Segment, ...], used: frozenset[str], rank: int
    ) -> None:
        """A quantizer's reduce-scatter of compressed shards: each chunk of this rank's gradient coded on its own
        and sent only to the rank that owns it (one all-to-all), every rank's codes of its own chunk decoded and
        summed in fp32 into ``buffer``'s chunk of this rank.

        Chunk ``j`` of a parameter is coded under the key ``name@j`` (its own scale, its own random rounding
        and, with error feedback, its own residual). The payload sizes go first, in a small all-to-all of their
        own. A compressor with state encodes into held state, committed at the step's end with these keys.
        """
        state, compressor, group = self.state, self.state.compressor, self.state.process_group
        world = layout.world
        prepare_compressor(state, buffer.device, state.iteration)
        self._sum_dense(buffer, segments, used)
        compressed = [s for s in segments if s.compressed and s.name in used]
        if not compressed:
            return
        columns = {p.name: p for p in layout.params}
        # Every chunk of every compressed parameter, destination by destination: (destination, segment, start, real).
        chunks = [
            (j, s, s.offset + j * columns[s.name].chunk, real)
            for j in range(world)
            for s in compressed
            if (real := max(0, min(columns[s.name].chunk, s.numel - j * columns[s.name].chunk)))
        ]
        pieces = [buffer[start : start + real] for _, _, start, real in chunks]
        keys = [f"{s.name}@{j}" for j, s, _, _ in chunks]
        started = time.perf_counter()
        encode = compressor.compress_pending_many if holds_steps(compressor) else compressor.compress_many
        payloads = encode(pieces, keys)
        state.codec_seconds["encode"] += time.perf_counter() - started
        if holds_steps(compressor):
            self.used |= set(keys)
        sent: dict[str, int] = {}
        for (_, s, _, _), payload in zip(chunks, payloads, strict=True):
            sent[s.name] = sent.get(s.name, 0) + payload.nbytes
        for s in compressed:
            state.layer_stats.book(s.name, s.numel, True, sent.get(s.name, 0))
        state.stats.payload_bytes += sum(p.nbytes for p in payloads)
        state.stats.payload_dense_equivalent_bytes += sum(s.numel for s in compressed) * buffer.element_size()
        wires = [p.to_wire() for p in payloads]
        # The sizes of every payload, then the payloads, each to the rank that owns its chunk.
        per_rank = [sum(1 for j, *_ in chunks if j == r) for r in range(world)]
        device = buffer.device  # NCCL moves device tensors only
        sizes = torch.tensor([w.numel() for w in wires], dtype=torch.int64)
        their_sizes = torch.empty(world * per_rank[rank], dtype=torch.int64, device=device)
        counted.all_to_all(state.stats, their_sizes, sizes.to(device), [per_rank[rank]] * world, per_rank, group).wait()
        their_sizes = their_sizes.cpu()
        sent_bytes = [int(sizes[sum(per_rank[:r]) : sum(per_rank[: r + 1])].sum()) for r in range(world)]
        received_bytes = [int(n) for n in their_sizes.view(world, per_rank[rank]).sum(dim=1)]
        received = torch.empty(sum(received_bytes), dtype=torch.uint8, device=device)
        send = torch.cat([w.to(device) for w in wires])
        counted.all_to_all(state.stats, received, send, received_bytes, sent_bytes, group).wait()
        # Decode: every rank's payload of each of this rank's chunks, summed in fp32 into the chunk.
        mine = [(s, start, real) for j, s, start, real in chunks if j == rank]
        parts = received.split(their_sizes.tolist())
        started = time.perf_counter()
        gathered: list[list[Any]] = [[] for _ in mine]
        for source in range(world):
            wires_in = parts[source * len(mine) : (source + 1) * len(mine)]
            parsed = compressor.payloads_from_wire_many(
                list(wires_in), [real for _, _, real in mine], [f"{s.name}@{rank}" for s, _, _ in mine]
            )
            for i, payload in enumerate(parsed):
                gathered[i].append(payload)
        outs = [buffer[start : start + real] for _, start, real in mine]
        compressor.aggregate_many(gathered, outs)
        state.codec_seconds["decode"] += time.perf_counter() - started

    def _as_stock(self, input: Tensor, output: Tensor, group: Any, op: Any) -> None:
        """Stock FSDP2's reduce-scatter of the whole group, counted."""
        counted.reduce_scatter(self.state.stats, output, input, group, op).wait()

    # -- the step ------------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        """The first group of a backward pass: queue the step's end, decide whether it compresses."""
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_step)
        except RuntimeError as err:
            raise RuntimeError(
                "lgc's compressed reduce-scatter ends a step with the backward pass that reduces it; FSDP2 reduced "
                "outside one (pipelining's stage backward?), which lgc does not support"
            ) from err
        self.in_step = True
        self.step_skipped = False
        self.used = set()
        self.compressing = self.state.iteration >= self.state.start_iter

    def _sync_buffers(self) -> None:
        """The module buffers in step, once per backward pass, at its end (as lgc's DDP hook keeps them: after the
        forward that updated them, before the next one; not earlier, where a BatchNorm's backward still holds them),
        over every rank, counted."""
        assert self._model is not None
        named = dict(self._model.named_buffers())
        kept = [named[name] for name in self._buffer_names]
        with torch.no_grad():
            if self.buffers == module_buffers.AVERAGE:
                module_buffers.average_step_buffers(self.state.stats, kept, self.guard_group)
            else:
                module_buffers.broadcast_buffers(self.state.stats, kept, self.guard_group)

    def _before_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        """A forward pass while a step is open: its backward raised before its end. Drop what it held."""
        if not self.in_step:
            return
        self.in_step = False
        state = self.state
        if self.compressing and state.guards_steps:
            compressor = state.compressor
            assert isinstance(compressor, HoldsSteps), compressor
            compressor.drop()
            state.begun_step = -1

    def _end_step(self) -> None:
        """The end of a backward pass that reduced: commit the held step, or drop it if a group was skipped."""
        state = self.state
        self.in_step = False
        if self._buffer_names:
            self._sync_buffers()
        compressor = state.compressor
        if self.compressing and state.guards_steps:
            assert isinstance(compressor, HoldsSteps), compressor
            if self.step_skipped:
                compressor.drop()
                state.begun_step = -1
            else:
                compressor.commit(frozenset(self.used))
        if self.step_skipped:
            state.stats.skipped_steps += 1
        else:
            state.iteration += 1
        state.step_done(skipped=self.step_skipped)


def param_groups(model: torch.nn.Module) -> tuple[list[tuple[FSDPModule, Any]], dist.ProcessGroup]:
    """Every FSDP module of ``model`` with its parameter group, and their one shard group; refuses what lgc cannot
    run: no parameter, a 2-D mesh (FSDP2's own HSDP), several meshes or parameter groups per module, a parameter
    sharded on another dim than 0."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [(m, g) for m in fsdp_modules(model) for g in m._get_fsdp_state()._fsdp_param_groups]
    if not groups:
        raise ValueError("lgc.compress found no parameter to reduce in the FSDP2 model")
    shard_pg = groups[0][1].mesh_info.shard_process_group
    for module, param_group in groups:
        mesh_info = param_group.mesh_info
        if getattr(mesh_info, "replicate_process_group", None) is not None:
            raise ValueError(
                "fully_shard over a 2-D mesh (FSDP2's own HSDP) all-reduces the replicas dense before any hook "
                "sees the gradient: shard over the shard dimension only, fully_shard(module, mesh=mesh['shard']), "
                "and pass lgc.compress(model, ..., replicate=mesh['replicate']), whose all-reduce lgc compresses"
            )
        if mesh_info.shard_process_group is not shard_pg:
            raise ValueError("lgc.compress needs every FSDP module of the model on one mesh")
        if len(module._get_fsdp_state()._fsdp_param_groups) > 1:
            raise ValueError(f"{type(module).__name__}: lgc.compress takes one parameter group per FSDP module")
        GroupLayout.of_group(param_group, names, mesh_info.shard_mesh_size, 1)  # refuses dim != 0
    return groups, shard_pg


def guard_flags(comm: CompressedReduceScatter, buffer: Tensor, segments: tuple[Segment, ...]) -> Tensor:
    """This rank's step-guard flags for one group (``1 + 3 n`` bytes, ``n`` its parameters that take a gradient):
    inf/NaN in ``segments`` of ``buffer``; per parameter, whether its gradient is nonzero, carried, and left out."""
    names = comm.all_names
    carried = [comm.flag_index[s.name] for s in segments]
    table = bucket_maxima(buffer, segments).float()
    flags = torch.zeros(1 + 3 * len(names), dtype=torch.uint8)
    flags[0] = int(not bool(torch.isfinite(table).all()))
    nonzero = (table != 0).to(torch.uint8)  # NaN counts as nonzero (its step is skipped anyway)
    for i, flag in zip(carried, nonzero.tolist(), strict=True):
        flags[1 + i] = flag
    mine = torch.zeros(len(names), dtype=torch.uint8)
    mine[carried] = 1
    flags[1 + len(names) :] = torch.cat([mine, 1 - mine])
    return flags


def read_guard_flags(comm: CompressedReduceScatter, flags: Tensor) -> StepVerdict:
    """The verdict of one group's :func:`guard_flags`, MAX-reduced over the ranks; refuses a parameter carried on
    some ranks and not on others, naming the fix."""
    names = comm.all_names
    some, missing = flags[1 + len(names) : 1 + 2 * len(names)], flags[1 + 2 * len(names) :]
    split = [names[i] for i in range(len(names)) if some[i] and missing[i]]
    if split:
        raise RuntimeError(
            f"{', '.join(split[:3])}: a gradient on some ranks and none on others, so the ranks' reduce-scatters "
            "differ; call model.set_reduce_scatter_unused_params(True), as FSDP2 needs when ranks use different "
            "parameters"
        )
    used = frozenset(names[i] for i in range(len(names)) if flags[1 + i])
    return StepVerdict(skip=bool(flags[0]), used=used)


def check_replicate(replicate: dist.ProcessGroup, shard_pg: dist.ProcessGroup) -> None:
    """Refuse a replicate group that does not complete the shard group to the world, or has one replica."""
    replicas, shards = dist.get_world_size(replicate), dist.get_world_size(shard_pg)
    if replicas < 2:
        raise ValueError(f"replicate= has {replicas} rank: lgc compresses the all-reduce across two or more replicas")
    if replicas * shards != dist.get_world_size():
        raise ValueError(
            f"replicate= has {replicas} ranks and the shard mesh {shards}, which do not make the world's "
            f"{dist.get_world_size()} ranks: build both from one 2-D mesh "
            "(init_device_mesh(..., (replicas, shards), mesh_dim_names=('replicate', 'shard')))"
        )
    if dist.get_rank(replicate) < 0 or dist.get_rank(shard_pg) < 0:
        raise ValueError("replicate= and the shard mesh must both hold this rank")


def codes_shards(compressor: Any) -> bool:
    """Whether FSDP2's compressed reduce-scatter codes ``compressor``'s chunks on their own (an all-to-all of
    compressed shards): a quantizer (:attr:`~lgc.compressors.Compressor.codes_every_entry`, with or without
    error feedback) that moves no state of its own on dense tensors. Sparsifiers select on the whole gradient."""
    return bool(compressor.codes_every_entry) and not compressor.transforms_dense


def broadcast_from_first_replica(model: torch.nn.Module, replicate: dist.ProcessGroup) -> None:
    """Every parameter shard as the first replica holds it, on every replica (DDP's broadcast at construction)."""
    source = dist.get_global_rank(replicate, 0)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            dist.broadcast(local, source, group=replicate)


def _divisor(op: Any, world: int, factor: float | None) -> float:
    """What FSDP2's reduce op divides the sum by: the world size (``AVG``), nothing (``SUM``: its fp16 reductions
    divide before and after, its ``force_sum_reduction_for_comms`` after) or ``set_gradient_divide_factor``'s
    factor (``PREMUL_SUM``)."""
    if op == dist.ReduceOp.AVG:
        return world
    if op == dist.ReduceOp.SUM:
        return 1
    if factor is None:
        raise ValueError(f"lgc's compressed reduce-scatter cannot tell what FSDP2's reduce op {op!r} divides by")
    return factor
