"""QSGD: unbiased stochastic quantization to ``s`` levels per bucket (Alistarh et al., NeurIPS 2017).

"QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding" quantizes each bucket
``v`` of ``d`` consecutive gradient entries to

    ``Q_s(v)_i = ||v||_2 * sign(v_i) * xi_i / s``,

where ``xi_i`` is ``|v_i| * s / ||v||_2`` rounded *stochastically* to one of its two neighbouring
integers ``l`` and ``l + 1`` (``l + 1`` with probability ``|v_i| s / ||v||_2 - l``). Hence
``E[Q_s(v)] = v`` (unbiased) and, by the paper's Lemma 3.1,

    ``E ||Q_s(v) - v||^2 <= min(d / s^2, sqrt(d) / s) * ||v||^2``.

Steps, per tensor (``key``):

1. Split the flat tensor into buckets of ``bucket_size`` consecutive entries (the last one may be
   shorter); every bucket gets its own ``||v||_2``, which keeps ``d`` in the variance bound small.
2. ``y = s * v / ||v||_2`` lies in ``[-s, s]``; round it stochastically: ``floor(y + u)`` with
   ``u ~ U[0, 1)``. This is the paper's rounding of ``|y|`` followed by the sign: stochastic
   rounding is symmetric, so both give the same distribution. It is computed as
   ``floor(s + y + u)`` in fp32 (the code directly, see 3.), so it is unbiased up to the fp32
   rounding of that sum: at most ``2**-23 * (2 s + 1)`` of a level step, far below the noise.
3. Send the norm (fp32) per bucket and the signed level ``q in [-s, s]`` as the unsigned code
   ``q + s`` of ``ceil(log2(2 s + 1))`` bits, packed MSB-first with :mod:`lgc.coding.bitpack`.

Wire format (:class:`QuantizedPayload`): ``4 * ceil(numel / bucket_size)`` bytes of fp32 norms,
then ``ceil(numel * b / 8)`` bytes of codes, ``b = ceil(log2(2 s + 1))``. That is exactly the
paper's "sign bit plus ``ceil(log2(s + 1))``-bit level" count (``ceil(log2(2 s + 1)) = 1 +
ceil(log2(s + 1))``), one code per element, so ``b + 32 / bucket_size`` bits per element:
4.0625 for the defaults (``s = 4``, buckets of 512), a 7.9x reduction from fp32.

**Deviation: no Elias coding.** The paper's encoding compresses the (mostly small) levels with
Elias integer coding, which pays off for large ``s`` and sparse level vectors (``s = sqrt(d)``:
at most ``2.8 d + 32`` bits). Here every code has the same width: packing and unpacking are a
few vectorized passes, and the payload has a fixed size for a given ``numel``
(``variable_size = False``), so the DDP hook allgathers without exchanging sizes first.

**Randomness.** Each tensor's uniforms come from a generator seeded, at every call, with a hash
of ``seed``, the tensor's name and how many times it was compressed before
(:func:`~lgc.compressors.base.keyed_seed`); the counts are the state
(:meth:`~StochasticQuantizer.state_dict`). A tensor's draws therefore never depend on which other
tensors a step compressed or in what order, so a resumed run draws the same numbers even though
DDP's first step after a restart groups the parameters into other buckets than the checkpointed
run's (DDP rebuilds them after its first iteration). A CPU and a CUDA generator give different
numbers for the same seed. Nothing rank-specific is needed for correctness: every worker's
quantization is unbiased whatever the seed, so ranks may share one. With a shared seed the workers
use the *same* uniforms, so their rounding errors are positively correlated and averaging over
``M`` workers reduces the quantization variance by less than ``1 / M`` (not at all for identical
gradients); pass a different ``seed`` per rank (e.g. ``seed + rank``) when independent noise
matters.

Payloads carry bit-packed codes, which cannot be summed by an allreduce: they are allgathered
(:attr:`CombineMode.GATHER`) and :meth:`~StochasticQuantizer.aggregate` decodes and sums them.

Why one module: QSGD and the quantizer TernGrad shares with it (one wire format, one rounding, one
randomness), tensor by tensor and over whole buckets, which must give the same bits.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import Field
from torch import Tensor

from lgc.coding.bitpack import byte_table, decode_bytes, pack_uint, packed_nbytes, unpack_uint
from lgc.compressors.base import CombineMode, Compressor, DecodesInto, HoldsSteps, Payload, keyed_seed, view_bytes_as
from lgc.compressors.segments import DecodesSegments, copy_segments_into, pad_segments, unpad_segments
from lgc.validation import PositiveInt, Seed, check

__all__ = ["MAX_LEVELS", "Buckets", "Levels", "QSGDCompressor", "QuantizedPayload", "StochasticQuantizer", "code_bits"]

#: Largest number of levels ``s`` accepted: the codes ``[0, 2 s]`` then fit in 16 bits.
MAX_LEVELS = 2**15 - 1
#: A number of positive quantization levels ``s``.
Levels = Annotated[int, Field(ge=1, le=MAX_LEVELS, description=f"an integer in [1, {MAX_LEVELS}]")]


def code_bits(levels: int) -> int:
    """Width of one code for ``levels`` levels: ``ceil(log2(2 * levels + 1))`` bits (codes ``0 .. 2 s``)."""
    return (2 * levels).bit_length()


@dataclass
class QuantizedPayload(Payload):
    """One fp32 scale per bucket and one bit-packed code per element.

    Code ``c`` of an element in a bucket with scale ``a`` decodes to ``(c - s) * a / s``, where
    ``s`` is the compressor's number of levels (QSGD: ``a = ||v||_2``; TernGrad: ``s = 1`` and
    ``a = max |v|``). Wire order: ``scales`` then ``codes``.
    """

    #: fp32, one per bucket.
    scales: Tensor
    #: uint8, the codes packed MSB-first by :func:`lgc.coding.bitpack.pack_uint`.
    codes: Tensor


class Buckets:
    """Consecutive buckets of ``size`` entries over a flat tensor of ``numel`` entries.

    The last bucket holds the remainder when ``size`` does not divide ``numel``; ``size=None``
    means one bucket for the whole tensor. Work is done on at most two 2-D views (the full
    buckets, then the short last one), so no per-bucket Python loop and no padding copy.
    """

    __slots__ = ("full", "numel", "size", "tail")

    def __init__(self, numel: int, size: int | None) -> None:
        self.numel = numel
        self.size = numel if size is None or size >= numel else size
        self.full = numel // self.size if self.size else 0
        self.tail = numel - self.full * self.size

    @property
    def count(self) -> int:
        """Number of buckets, ``ceil(numel / size)``."""
        return self.full + (1 if self.tail else 0)

    def views(self, flat: Tensor) -> list[Tensor]:
        """``flat`` (contiguous, ``numel`` entries) as ``(rows, bucket)`` views, full buckets first."""
        parts = []
        if self.full:
            parts.append(flat[: self.full * self.size].view(self.full, self.size))
        if self.tail:
            parts.append(flat[self.full * self.size :].view(1, self.tail))
        return parts

    def columns(self, per_bucket: Tensor) -> list[Tensor]:
        """One value per bucket as ``(rows, 1)`` columns matching :meth:`views`, to broadcast over buckets."""
        column = per_bucket.reshape(-1, 1)
        parts = []
        if self.full:
            parts.append(column[: self.full])
        if self.tail:
            parts.append(column[self.full :])
        return parts

    def scale_(self, flat: Tensor, per_bucket: Tensor) -> Tensor:
        """Multiply every bucket of ``flat`` (contiguous, ``numel`` entries) by its value, in place."""
        for view, factor in zip(self.views(flat), self.columns(per_bucket), strict=True):
            view.mul_(factor)
        return flat

    def lengths(self) -> list[int]:
        """Every bucket's number of entries, in order."""
        return [self.size] * self.full + ([self.tail] if self.tail else [])

    def reduce(self, flat: Tensor, row_fn: Callable[[Tensor], Tensor]) -> Tensor:
        """``row_fn`` (a reduction over ``dim=1``) applied to every bucket: one value per bucket."""
        parts = [row_fn(view) for view in self.views(flat)]
        return torch.cat(parts) if parts else flat.new_zeros(0)


class StochasticQuantizer(HoldsSteps, DecodesSegments, DecodesInto, Compressor):
    """Unbiased stochastic rounding of ``s * v / scale`` to the integers ``-s .. s``, per bucket.

    The shared machinery of :class:`QSGDCompressor` (``scale = ||v||_2``) and
    :class:`~lgc.compressors.terngrad.TernGradCompressor` (``s = 1``, ``scale = max |v|``):
    subclasses only choose the per-bucket scale. Wire format: :class:`QuantizedPayload`.

    Non-finite inputs (an fp16 overflow under AMP) make their bucket's scale non-finite, and the
    whole bucket then decodes to NaN, so a gradient scaler still sees the overflow after
    aggregation.

    ``compress`` keeps scratch buffers per device the size of the largest tensor seen (fp32 for the
    random numbers, one byte per entry for the codes), so steady-state compression allocates no
    gradient-sized memory; call it from one thread at a time, as the DDP hook does.

    Args:
        levels: ``s``, the number of positive quantization levels.
        bucket_size: entries per bucket, or None for one bucket per tensor.
        seed: seed of the random rounding (see the module docstring about ranks).
    """

    combine = CombineMode.GATHER
    variable_size = False
    codes_every_entry = True

    def __init__(self, levels: Levels, bucket_size: PositiveInt | None, seed: Seed = 0) -> None:
        check("levels", levels, Levels)
        check("bucket_size", bucket_size, PositiveInt | None)
        check("seed", seed, Seed)
        self.levels = levels
        self.bucket_size = bucket_size
        self.seed = seed
        #: Bits per element on the wire (the scales come on top).
        self.code_bits = code_bits(levels)
        #: How many times each key was compressed: with ``seed`` and the key, the seed of its next
        #: draws (:func:`~lgc.compressors.base.keyed_seed`); the whole random state.
        self.draws: dict[str, int] = {}
        #: A step encoded ahead of the ranks' agreement (:meth:`compress_pending`): key -> its count
        #: after the step, adopted by :meth:`commit`.
        self._pending: dict[str, int] = {}
        # One generator per device ("cpu", "cuda:0"), reseeded before every tensor's draws.
        self._generators: dict[str, torch.Generator] = {}
        # Scratch buffers per (device, dtype): a fresh gradient-sized CPU allocation costs as much as
        # several arithmetic passes (page faults), so the uniforms and codes go to reused buffers.
        self._workspace: dict[tuple[str, torch.dtype], Tensor] = {}
        # Per device: the signed levels of every byte value, for decoding byte-aligned codes.
        self._tables: dict[str, Tensor] = {}

    @property
    def scale_covers_input(self) -> bool:
        """Whether every ``|v|`` is at most its bucket's scale (false when the scale clips entries)."""
        return True

    @abc.abstractmethod
    def bucket_scales(self, flat: Tensor, buckets: Buckets) -> Tensor:
        """The fp32 scale of every bucket of ``flat``: level ``s`` decodes to ``+-scale``."""

    def payload_nbytes(self, numel: int) -> int:
        """Exact wire size for a tensor of ``numel`` entries (the same for every input)."""
        return 4 * Buckets(numel, self.bucket_size).count + packed_nbytes(numel * self.code_bits)

    def compress(self, tensor: Tensor, key: str) -> QuantizedPayload:
        count = self.draws.get(key, 0)
        payload = self._quantize(tensor, key, count)
        self.draws[key] = count + 1
        return payload

    # -- encoding ahead of the step's agreement (the hook's overlap: HoldsSteps) -------------------------
    # A key's draws follow from its count alone, which commit advances.

    def compress_pending(self, tensor: Tensor, key: str) -> QuantizedPayload:
        """:meth:`compress`'s payload, the key's count of draws left as it is until :meth:`commit`."""
        count = self.draws.get(key, 0)
        payload = self._quantize(tensor, key, count)
        self._pending[key] = count + 1
        return payload

    def commit(self, keys: frozenset[str] | set[str]) -> None:
        """Advance the counts of ``keys`` by the held step; the others' stay (``frozenset()``: drop it)."""
        pending, self._pending = self._pending, {}
        for key, count in pending.items():
            if key in keys:
                self.draws[key] = count

    def _quantize(self, tensor: Tensor, key: str, count: int) -> QuantizedPayload:
        """The payload of ``tensor`` with ``key``'s ``count``-th draws."""
        flat = tensor.reshape(-1).contiguous().float()
        numel, s = flat.numel(), self.levels
        buckets = Buckets(numel, self.bucket_size)
        scales = self.bucket_scales(flat, buckets).float()
        multiplier = s / scales
        # A zero bucket (and a non-finite one) gets multiplier 0: every level is 0, no 0/0.
        multiplier = torch.where(torch.isfinite(multiplier), multiplier, 0.0)
        # u + s with u ~ U[0, 1); adding y = s * v / scale in [-s, s] gives s + y + u in [0, 2 s + 1).
        work = self._scratch(numel, torch.float32, flat.device)
        work.uniform_(s, s + 1.0, generator=self._generator(flat.device, key, count))
        for out, values, factor in zip(
            buckets.views(work), buckets.views(flat), buckets.columns(multiplier), strict=True
        ):
            out.addcmul_(values, factor)
        codes = self._codes(work, finite=bool(torch.isfinite(scales).all()))
        return QuantizedPayload(numel=numel, scales=scales, codes=pack_uint(codes, self.code_bits))

    def _codes(self, work: Tensor, finite: bool) -> Tensor:
        """The unsigned codes of ``work`` (``s + y + u`` per entry, in place): one per entry, unpacked."""
        s = self.levels
        if not finite:
            work.nan_to_num_(nan=s, posinf=s, neginf=s)  # inf * 0 above; the scale carries the NaN
        if not self.scale_covers_input:
            work.clamp_(0.0, 2 * s)  # entries beyond +-scale (clipped ones) go to the extreme levels
        # The code is floor(s + y + u): y rounded up with probability frac(y), i.e. unbiased. The
        # values are >= 0 up to a rounding error (> -1), so the conversion's truncation is the floor;
        # the clamp only catches fp32 rounding at the top edge. int8 converts fastest.
        numel = work.numel()
        if 2 * s + 1 <= 127:
            return self._scratch(numel, torch.int8, work.device).copy_(work).clamp_max_(2 * s).view(torch.uint8)
        if s <= 127:
            return self._scratch(numel, torch.uint8, work.device).copy_(work).clamp_max_(2 * s)
        return self._scratch(numel, torch.int32, work.device).copy_(work).clamp_(0, 2 * s)

    # -- a bucket at once (a GPU's default) -----------------------------------------------------

    def segments_supported(self) -> bool:
        """Codes of 1, 2, 4 or 8 bits (``s`` = 1 and 4 to 127): whole codes per byte."""
        return 8 % self.code_bits == 0

    def compress_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        if len(tensors) < 2 or not self.batches_on(tensors[0].device) or len(set(keys)) != len(keys):
            return super().compress_many(tensors, keys)
        return self._compress_bucket(tensors, keys)

    def _compress_bucket(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[QuantizedPayload]:
        """:meth:`compress_segments` with every key's next draws, the keys' counts advanced as :meth:`compress`'s."""
        counts = [self.draws.get(key, 0) for key in keys]
        payloads = self.compress_segments(tensors, keys, counts)
        for key, count in zip(keys, counts, strict=True):
            self.draws[key] = count + 1
        return payloads

    def _padded_codes(self, numels: Sequence[int]) -> list[int]:
        """Every tensor's count of codes padded to whole bytes (the bucket path's layout of the packed codes)."""
        per_byte = 8 // self.code_bits
        return [-(-n // per_byte) * per_byte for n in numels]

    def _bucket_lengths(self, numels: Sequence[int], device: torch.device) -> Tensor:
        """Every scaling bucket's number of entries, tensor after tensor (int64, on ``device``)."""
        lengths = [length for n in numels for length in Buckets(n, self.bucket_size).lengths()]
        return torch.tensor(lengths, dtype=torch.int64, device=device)

    def feed_back_segments(self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]) -> list[QuantizedPayload]:
        """A bucket at once under error feedback (:class:`~lgc.compressors.segments.FeedsBackSegments`): the
        payloads of :meth:`compress_many`'s bucket path, every key's draws advanced, and what they decode
        to (:meth:`decode_segments` of this worker's payloads alone) subtracted from ``flat``. Bit for
        bit error feedback's loop over :meth:`compress`, whose subtraction is of :meth:`decompress`.
        Codes that straddle bytes have no bucket pass (:meth:`segments_supported`): error feedback
        then keeps its own loop (its ``batches_on``), and a direct call is refused."""
        if not self.segments_supported():
            raise ValueError(
                f"feed_back_segments needs codes of 1, 2, 4 or 8 bits, got {self.code_bits} (levels={self.levels})"
            )
        segments = list(flat.split(list(numels)))
        payloads = self._compress_bucket(segments, keys)
        sent = torch.empty_like(flat)
        self.decode_segments([[payload] for payload in payloads], list(sent.split(list(numels))))
        flat.sub_(sent)
        return payloads

    def compress_segments(
        self, tensors: Sequence[Tensor], keys: Sequence[str], counts: Sequence[int]
    ) -> list[QuantizedPayload]:
        """Every tensor's payload (``keys[i]``'s ``counts[i]``-th draws), :meth:`compress`'s bit for bit.

        The scales are each tensor's own reduction (:meth:`bucket_scales`, so they round as the
        per-tensor path's) and the uniforms each tensor's own draws from its keyed generator (a
        tensor's numbers never depend on the others'): one reduction and one draw per tensor.
        Everything else runs once over the bucket laid end to end: the scaling (each bucket's
        multiplier repeated over its entries), the rounding to codes and the packing, every tensor
        padded to whole bytes of codes. Needs ``8 % code_bits == 0``.
        """
        if 8 % self.code_bits:
            raise ValueError(f"compress_segments needs codes of 1, 2, 4 or 8 bits, got {self.code_bits}")
        s, device = self.levels, tensors[0].device
        flats = [t.reshape(-1).contiguous().float() for t in tensors]
        numels = [flat.numel() for flat in flats]
        layouts = [Buckets(n, self.bucket_size) for n in numels]
        scales = [self.bucket_scales(flat, b).float() for flat, b in zip(flats, layouts, strict=True)]
        every_scale = torch.cat(scales)
        multiplier = s / every_scale
        multiplier = torch.where(torch.isfinite(multiplier), multiplier, 0.0)
        lengths = self._bucket_lengths(numels, device)
        total = sum(numels)
        work = self._scratch(total, torch.float32, device)
        for piece, key, count in zip(work.split(numels), keys, counts, strict=True):
            piece.uniform_(s, s + 1.0, generator=self._generator(device, key, count))
        work.addcmul_(torch.cat(flats), multiplier.repeat_interleave(lengths, output_size=total))
        codes = self._codes(work, finite=bool(torch.isfinite(every_scale).all()))
        per_byte, padded = 8 // self.code_bits, self._padded_codes(numels)
        packed = pack_uint(pad_segments(codes.split(numels), padded), self.code_bits)
        return [
            QuantizedPayload(numel=n, scales=scale, codes=piece)
            for n, scale, piece in zip(numels, scales, packed.split([p // per_byte for p in padded]), strict=True)
        ]

    def decode_segments(self, payloads: Sequence[Sequence[QuantizedPayload]], outs: Sequence[Tensor]) -> None:
        """Every rank's payloads of a bucket's tensors (``payloads[i]``: tensor ``i``'s, in rank order) summed
        into ``outs``, bit for bit as :meth:`aggregate_into` tensor by tensor.

        Per rank, every tensor's codes are looked up at once (one table lookup over the bucket's
        bytes, each tensor padded to whole bytes) and scaled at once (each bucket's ``scale / s``
        repeated over its entries); the ranks' decodes are summed in fp32 in rank order, then cast
        into the tensors' slices of the bucket with one multi-tensor copy.
        """
        if 8 % self.code_bits:
            raise ValueError(f"decode_segments needs codes of 1, 2, 4 or 8 bits, got {self.code_bits}")
        device, s = outs[0].device, self.levels
        numels = [out.numel() for out in outs]
        padded, lengths = self._padded_codes(numels), self._bucket_lengths(numels, device)
        total = sum(numels)
        table = self._level_table(device)
        scratch = torch.empty(sum(padded), dtype=torch.float32, device=device)
        result: Tensor | None = None
        for rank in range(len(payloads[0])):
            received = [payloads[i][rank] for i in range(len(outs))]
            codes = torch.cat([p.codes.contiguous() for p in received])
            levels = unpad_segments(decode_bytes(codes, table, sum(padded), scratch), padded, numels)
            factors = torch.cat([p.scales.float() for p in received]) / s
            levels.mul_(factors.repeat_interleave(lengths, output_size=total))
            result = levels if result is None else result.add_(levels)
        assert result is not None
        copy_segments_into(result, outs)

    def _decode(self, payload: QuantizedPayload, out: Tensor) -> Tensor:
        """Decode into ``out`` (fp32, ``numel`` entries): ``(code - s) * scale / s`` per bucket."""
        numel, s, bits = payload.numel, self.levels, self.code_bits
        if 8 % bits == 0:
            # Whole codes per byte (2, 4 or 8 bits): one table lookup per byte gives all its levels.
            decode_bytes(payload.codes, self._level_table(out.device), numel, out)
        else:
            dtype = torch.uint8 if bits <= 8 else torch.int32
            out.copy_(unpack_uint(payload.codes, bits, numel, dtype=dtype))
            out.sub_(s)
        return Buckets(numel, self.bucket_size).scale_(out, payload.scales.float() / s)

    def _level_table(self, device: torch.device) -> Tensor:
        """``(256, 8 // b)`` fp32: the signed levels ``code - s`` of the codes packed in each byte value."""
        name = str(device)
        table = self._tables.get(name)
        if table is None:
            levels = torch.arange(2**self.code_bits, dtype=torch.float32) - self.levels
            table = byte_table(levels, self.code_bits).to(device)
            self._tables[name] = table
        return table

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> QuantizedPayload:
        scale_bytes = 4 * Buckets(numel, self.bucket_size).count
        expected = scale_bytes + packed_nbytes(numel * self.code_bits)
        if wire.numel() != expected:
            raise ValueError(f"{self!r} payload for {numel} elements has {expected} bytes, got {wire.numel()}")
        return QuantizedPayload(
            numel=numel, scales=view_bytes_as(wire[:scale_bytes], torch.float32), codes=wire[scale_bytes:]
        )

    # Randomness -----------------------------------------------------------------------------

    def _generator(self, device: torch.device | str, key: str, count: int) -> torch.Generator:
        """This device's generator, seeded for ``key``'s ``count``-th draws (:func:`keyed_seed`)."""
        name = str(torch.device(device))
        gen = self._generators.get(name)
        if gen is None:
            gen = self._generators[name] = torch.Generator(device=name)
        return gen.manual_seed(keyed_seed(self.seed, key, count))

    def _scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A reused buffer of ``numel`` entries (contents undefined), grown to the largest tensor seen."""
        key = (str(device), dtype)
        buffer = self._workspace.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._workspace[key] = buffer
        return buffer[:numel]

    def state_dict(self) -> dict[str, Any]:
        """The seed and every key's count of draws."""
        return {"seed": self.seed, "draws": dict(self.draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"seed", "draws"}:
            raise ValueError(
                f"{type(self).__name__} state needs keys 'seed' and 'draws' (each tensor's count of draws), "
                f"got {sorted(state)}"
            )
        self.seed = int(state["seed"])
        self.draws = {str(key): int(count) for key, count in state["draws"].items()}
        self._pending = {}

    # Generators do not pickle (the hook state is pickled to spawned workers); the draws are the state.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_generators"] = {}
        state["_pending"] = {}
        state["_workspace"] = {}
        state["_tables"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class QSGDCompressor(StochasticQuantizer):
    """QSGD (Alistarh et al., 2017): unbiased stochastic quantization to ``s`` levels of ``||v||_2``.

    See the module docstring for the algorithm, the wire format and the randomness. Combine with
    :class:`~lgc.compressors.ErrorFeedback` only if you want to: QSGD is unbiased and converges
    without it (the yaml default is ``error_feedback: false``).

    Args:
        levels: ``s`` (default 4). Codes take ``ceil(log2(2 s + 1))`` bits, so the levels that
            fill their code space are ``s = 2**(b - 1) - 1``: 1 (2 bits, ternary), 3 (3 bits),
            7 (4 bits), 127 (8 bits). ``s = 4`` costs as many bits as ``s = 7`` but is noisier;
            raise ``levels`` when training is noisier than dense SGD (the variance shrinks like
            ``1 / s`` to ``1 / s**2``), lower it to save bytes.
        bucket_size: entries per bucket with their own norm (default 512; None: one bucket per
            tensor). Smaller buckets lower the variance (the bound grows with ``d``) and cost
            ``32 / bucket_size`` bits per element for the norms. The paper's experiments use
            buckets of a few hundred to a few thousand entries (512 for its 4-bit runs [?]).
        seed: seed of the stochastic rounding.

    Example::

        >>> qsgd = QSGDCompressor(levels=4, bucket_size=512)
        >>> payload = qsgd.compress(torch.randn(1000), key="w")
        >>> payload.nbytes  # two fp32 norms + 1000 four-bit codes
        508
    """

    def __init__(self, levels: Levels = 4, bucket_size: PositiveInt | None = 512, seed: Seed = 0) -> None:
        super().__init__(levels=levels, bucket_size=bucket_size, seed=seed)

    def bucket_scales(self, flat: Tensor, buckets: Buckets) -> Tensor:
        return buckets.reduce(flat, lambda rows: torch.linalg.vector_norm(rows, dim=1))

    def variance_bound(self, tensor: Tensor) -> float:
        """Lemma 3.1 summed over buckets: ``sum_b min(d_b / s^2, sqrt(d_b) / s) * ||v_b||^2``."""
        flat = tensor.reshape(-1).contiguous().float()
        buckets = Buckets(flat.numel(), self.bucket_size)
        total = 0.0
        for rows in buckets.views(flat):
            total += self._variance_factor(rows.shape[1]) * float(rows.double().square().sum())
        return total

    def _variance_factor(self, d: int) -> float:
        """Lemma 3.1's bound on ``E ||Q(v) - v||^2 / ||v||^2`` for a bucket of ``d`` entries."""
        s = self.levels
        return min(d / s**2, math.sqrt(d) / s)

    def error_feedback_diverges(self) -> str | None:
        """Why error feedback around this quantizer grows without bound, or None where it is a contraction.

        Error feedback keeps ``g - Q(g)`` and adds it to the next gradient; it stays bounded only when
        ``E ||Q(g) - g||^2 < ||g||^2``. QSGD's bound (Lemma 3.1) is ``min(d / s^2, sqrt(d) / s)`` times
        ``||g||^2`` per bucket of ``d`` entries, below 1 only for ``s > sqrt(d)``.
        """
        if self.bucket_size is None:
            return (
                "with one bucket per tensor (bucket_size=None) its error can exceed the gradient on any tensor of "
                "more than levels**2 entries"
            )
        if self.levels**2 > self.bucket_size:
            return None
        return (
            f"with levels={self.levels} and bucket_size={self.bucket_size} its error can exceed the gradient "
            f"(variance bound {self._variance_factor(self.bucket_size):.3g} "
            "x ||g||^2, Lemma 3.1), so the residual grows without bound: error feedback needs levels > "
            "sqrt(bucket_size)"
        )

    def __repr__(self) -> str:
        return f"QSGDCompressor(levels={self.levels}, bucket_size={self.bucket_size}, seed={self.seed})"
