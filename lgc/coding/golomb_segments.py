"""Golomb-Rice codes of several position sets at once: a DDP bucket's tensors in a fixed number of passes.

SBC (Sattler et al. 2019) Golomb-codes every tensor's positions (:mod:`lgc.coding.golomb`, whose
docstring gives the code and its layout). A DDP bucket holds many tensors, and on a GPU a few
kernels per tensor cost more than the arithmetic: :func:`golomb_encode_segments` writes every
tensor's stream into one bit array, each at a whole byte after its header, and packs it once;
:func:`golomb_decode_segments` unpacks every received stream at once and finds every code's
terminators, quotients and remainders together. Both give :func:`~lgc.coding.golomb.golomb_encode`'s
buffers and :func:`~lgc.coding.golomb.golomb_decode`'s positions bit for bit; the decoder makes their
checks code by code, the encoder takes every set's positions ascending (where ``golomb_encode``
sorts them) and refuses them otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lgc.coding.bitpack import pack_bits, packed_nbytes, unpack_bits
from lgc.coding.golomb import HEADER_BYTES, _check_parameter, optimal_golomb_parameter

__all__ = ["golomb_decode_segments", "golomb_encode_segments"]


def golomb_encode_segments(
    positions: Tensor, numels: Sequence[int], counts: Sequence[int], b: int | None = None
) -> list[Tensor]:
    """:func:`golomb_encode`'s wire buffers (:meth:`GolombCode.to_wire`) of several position sets at once.

    Set ``i`` is ``counts[i]`` consecutive entries of ``positions``, ascending and distinct, in
    ``[0, numels[i])`` (one tensor's positions in a DDP bucket, local to it). The streams are
    written into one bit array, each at a whole byte after its header, and packed at once; every
    returned buffer is a view of one ``uint8`` tensor, bit for bit the one :func:`golomb_encode`
    and :meth:`GolombCode.to_wire` give. A fixed number of passes whatever the number of sets,
    which on a GPU is what a bucket costs; ``b`` as in :func:`golomb_encode` (``None``: each set's
    own ``b*``).

    Raises:
        ValueError: on positions that are not ascending and distinct within a set, or outside it.
    """
    positions = positions.reshape(-1).to(torch.int64)
    device, sets = positions.device, len(counts)
    if len(numels) != sets or sum(counts) != positions.numel() or any(map(int.__gt__, counts, numels)):
        raise ValueError(
            f"sets of {list(counts)} positions in {list(numels)} entries, got {positions.numel()} positions"
        )
    params = [
        optimal_golomb_parameter(c / n) if c and b is None else (b or 0) for c, n in zip(counts, numels, strict=True)
    ]
    for param in params:
        _check_parameter(param)
    total = positions.numel()
    count_t = torch.tensor(list(counts), dtype=torch.int64, device=device)
    owner = torch.repeat_interleave(torch.arange(sets, device=device), count_t, output_size=total)
    first = count_t.cumsum(0) - count_t  # each set's first entry
    # Step 1: gaps d >= 1, the first of every set its position + 1.
    previous = torch.cat([positions.new_full((1,), -1), positions[:-1]]) if total else positions
    previous[first[count_t > 0]] = -1
    gaps = positions - previous
    if total:
        limit = torch.tensor(list(numels), dtype=torch.int64, device=device)[owner]
        if bool(((gaps < 1) | (positions >= limit)).any()):
            raise ValueError("every set's positions must be ascending, distinct and within its tensor")
    # Step 2: d - 1 = q * 2**b + r, with each set's b.
    b_t = torch.tensor(params, dtype=torch.int64, device=device)
    b_of = b_t[owner]
    offsets = gaps - 1
    quotients = offsets >> b_of
    unary = torch.zeros(sets, dtype=torch.int64, device=device).index_add_(0, owner, quotients)
    num_bits = [c * (param + 1) + int(q) for c, param, q in zip(counts, params, unary.tolist(), strict=True)]
    nbytes = [HEADER_BYTES + packed_nbytes(bits) for bits in num_bits]
    wire_starts = [0]
    for size in nbytes:
        wire_starts.append(wire_starts[-1] + size)
    # Step 3: one bit array for every stream, each at a whole byte after its header; ones from a
    # set's unary run to its end, then its remainders' bits and a zero at each terminator.
    stream_start = torch.tensor([8 * (a + HEADER_BYTES) for a in wire_starts[:-1]], dtype=torch.int64, device=device)
    remainder_bits = count_t * b_t
    ones = torch.zeros(8 * wire_starts[-1] + 1, dtype=torch.int32, device=device)
    ones.index_add_(0, stream_start + remainder_bits, torch.ones(sets, dtype=torch.int32, device=device))
    ends = stream_start + torch.tensor(num_bits, dtype=torch.int64, device=device)
    ones.index_add_(0, ends, torch.full((sets,), -1, dtype=torch.int32, device=device))
    stream = ones.cumsum(0)[:-1] > 0
    if total:
        within = torch.arange(total, device=device) - first[owner]
        steps = torch.cumsum(quotients + 1, dim=0)
        before = (steps - (quotients + 1))[first[owner]]  # the unary bits of the set's earlier entries
        stream[stream_start[owner] + remainder_bits[owner] + steps - before - 1] = False
        widths = b_of
        bit_count = int(remainder_bits.sum())
        if bit_count:
            entry = torch.repeat_interleave(torch.arange(total, device=device), widths, output_size=bit_count)
            digit = torch.arange(bit_count, device=device) - (widths.cumsum(0) - widths)[entry]
            where = stream_start[owner[entry]] + within[entry] * widths[entry] + digit
            stream[where] = ((offsets[entry] >> (widths[entry] - 1 - digit)) & 1).bool()
    # Step 4: pack once, then each header: count (uint32, little-endian) and b.
    wire = pack_bits(stream)
    header = torch.tensor(
        [[(c >> (8 * i)) & 0xFF for i in range(4)] + [param] for c, param in zip(counts, params, strict=True)],
        dtype=torch.uint8,
    ).to(device)
    header_at = torch.tensor(wire_starts[:-1], dtype=torch.int64, device=device).unsqueeze(1) + torch.arange(
        HEADER_BYTES, device=device
    )
    wire[header_at.reshape(-1)] = header.reshape(-1)
    return list(wire.split(nbytes))


def golomb_decode_segments(wires: Sequence[Tensor]) -> list[Tensor]:
    """:func:`golomb_decode` of several wire buffers (:meth:`GolombCode.to_wire`) at once: each one's sorted positions.

    The headers are read with one transfer to the host, the streams laid end to end and unpacked
    once, and every code's terminators, quotients and remainders found in a fixed number of passes
    whatever the number of codes (the receiving side of :func:`golomb_encode_segments`). The checks
    are :meth:`GolombCode.from_wire`'s and :func:`golomb_decode`'s, code by code.

    Raises:
        ValueError: on a buffer too short for its header, a bad ``b``, or a stream that does not
            hold exactly its header's count of code words.
    """
    if not wires:
        return []
    device = wires[0].device
    for i, wire in enumerate(wires):
        if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() < HEADER_BYTES:
            raise ValueError(f"Golomb wire buffer {i} is not a 1-D uint8 tensor of >= {HEADER_BYTES} bytes")
    headers = torch.stack([wire[:HEADER_BYTES] for wire in wires]).tolist()
    counts = [sum(byte << (8 * j) for j, byte in enumerate(header[:4])) for header in headers]
    params = [header[4] for header in headers]
    for param in params:
        _check_parameter(param)
    nbytes = [wire.numel() - HEADER_BYTES for wire in wires]
    starts = [0]
    for size in nbytes:
        starts.append(starts[-1] + 8 * size)
    stream = unpack_bits(torch.cat([wire[HEADER_BYTES:] for wire in wires]), starts[-1])
    codes = len(wires)
    count_t = torch.tensor(counts, dtype=torch.int64, device=device)
    b_t = torch.tensor(params, dtype=torch.int64, device=device)
    start_t = torch.tensor(starts[:-1], dtype=torch.int64, device=device)
    unary_start = start_t + count_t * b_t
    # Which code each bit belongs to, and whether it lies in that code's unary run.
    owner_of_bit = torch.repeat_interleave(
        torch.arange(codes, device=device), torch.tensor([8 * n for n in nbytes], device=device), output_size=starts[-1]
    )
    in_unary = torch.arange(starts[-1], device=device) >= unary_start[owner_of_bit]
    ones = torch.zeros(codes, dtype=torch.int64, device=device).index_add_(0, owner_of_bit, (stream & in_unary).long())
    num_bits = count_t * (b_t + 1) + ones
    zeros = torch.nonzero(~stream & in_unary).squeeze(1)
    zero_owner = owner_of_bit[zeros]
    zero_first = torch.searchsorted(zero_owner, torch.arange(codes, device=device))
    rank = torch.arange(zeros.numel(), device=device) - zero_first[zero_owner]
    terminators = zeros[rank < count_t[zero_owner]]
    found = torch.bincount(zero_owner[rank < count_t[zero_owner]], minlength=codes)
    last = torch.full((codes,), -1, dtype=torch.int64, device=device).scatter_reduce_(
        0, owner_of_bit[terminators], terminators - start_t[owner_of_bit[terminators]], "amax"
    )
    summary = torch.stack([num_bits, found, last]).tolist()
    for i, (bits, hits, end) in enumerate(zip(*summary, strict=True)):
        if counts[i] == 0:
            if nbytes[i]:
                raise ValueError(f"corrupt Golomb buffer {i}: no positions but {nbytes[i]} stream bytes")
            continue
        if packed_nbytes(bits) != nbytes[i]:
            raise ValueError(
                f"corrupt Golomb buffer {i}: header says {counts[i]} positions with b={params[i]} ({bits} bits), "
                f"but {nbytes[i]} stream bytes follow"
            )
        if hits != counts[i] or end != bits - 1:
            raise ValueError(f"corrupt Golomb stream {i}: expected {counts[i]} unary terminators at its end")
    total = sum(counts)
    entry_owner = torch.repeat_interleave(torch.arange(codes, device=device), count_t, output_size=total)
    entry_first = count_t.cumsum(0) - count_t
    # Quotients: the gaps between a code's terminators, less one (its first: the terminator's place).
    previous = torch.cat([terminators.new_full((1,), -1), terminators[:-1]]) if total else terminators
    previous[entry_first[count_t > 0]] = unary_start[count_t > 0] - 1
    offsets = (terminators - previous - 1) << b_t[entry_owner]
    widths = b_t[entry_owner]
    bit_count = int((count_t * b_t).sum())
    if bit_count:
        entry = torch.repeat_interleave(torch.arange(total, device=device), widths, output_size=bit_count)
        digit = torch.arange(bit_count, device=device) - (widths.cumsum(0) - widths)[entry]
        within = entry - entry_first[entry_owner[entry]]
        where = start_t[entry_owner[entry]] + within * widths[entry] + digit
        offsets.index_add_(0, entry, stream[where].long() << (widths[entry] - 1 - digit))
    steps = torch.cumsum(offsets + 1, dim=0)
    before = (steps - (offsets + 1))[entry_first[entry_owner]]
    return list((steps - before - 1).split(counts))
