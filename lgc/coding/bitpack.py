"""Bit packing: boolean masks and small unsigned codes to bytes and back.

Quantizers put a few bits per element on the wire: signSGD one sign bit (Bernstein et al. 2018),
TernGrad two bits for {-1, 0, 1} (Wen et al. 2017), QSGD ``ceil(log2(s + 1))`` bits for ``s``
levels plus a sign (Alistarh et al. 2017). These helpers turn such codes into the dense ``uint8``
buffer that is actually sent, so the payload's byte count is exact.

Layout: a stream of bits is packed MSB-first within each byte (bit ``i`` of the stream is bit
``7 - i % 8`` of byte ``i // 8``, as :func:`numpy.packbits` with ``bitorder="big"``); the last byte is
padded with zero bits. An unsigned code of ``w`` bits is written most significant bit first, codes
one after another with no gaps, so ``n`` codes take ``ceil(n * w / 8)`` bytes.

CPU tensors go through :func:`numpy.packbits` / :func:`numpy.unpackbits` (fast C loops, zero-copy
views); other devices use an equivalent pure-torch path, so nothing leaves the GPU.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MAX_UINT_BITS",
    "byte_table",
    "check_packed",
    "decode_bytes",
    "pack_bits",
    "pack_uint",
    "packed_nbytes",
    "unpack_bits",
    "unpack_uint",
]

#: Widest unsigned code :func:`pack_uint` accepts.
MAX_UINT_BITS = 32


def packed_nbytes(num_bits: int) -> int:
    """Bytes needed for ``num_bits`` bits: ``ceil(num_bits / 8)``."""
    return (num_bits + 7) // 8


def pack_bits(bits: Tensor) -> Tensor:
    """Pack a flat stream of bits into bytes, MSB-first, zero-padding the last byte.

    Args:
        bits: 1-D ``bool`` tensor, or an integer tensor whose non-zero entries count as ones.

    Returns:
        1-D ``uint8`` tensor of ``ceil(bits.numel() / 8)`` bytes on the same device.

    Example::

        >>> pack_bits(torch.tensor([True, False, True, True, False, False, False, False, True])).tolist()
        [176, 128]
    """
    bits = bits.reshape(-1)
    if bits.device.type == "cpu":
        array = bits.detach().numpy() if bits.dtype == torch.bool else (bits != 0).numpy()
        return torch.from_numpy(np.packbits(array, bitorder="big"))
    return _pack_bits_torch(bits)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits of ``packed`` as a ``bool`` tensor.

    Args:
        packed: 1-D ``uint8`` tensor.
        n: number of bits to return, at most ``8 * packed.numel()``.
    """
    packed = check_packed(packed, n)
    if packed.device.type == "cpu":
        array = np.unpackbits(packed.numpy(), count=n, bitorder="big")
        return torch.from_numpy(array).view(torch.bool)  # unpackbits yields only 0 and 1
    return _unpack_bits_torch(packed, n)


def pack_uint(values: Tensor, bits: int) -> Tensor:
    """Pack unsigned integer codes of a fixed width ``bits`` into bytes, MSB-first, no gaps.

    Widths that divide 8 (sign bits, TernGrad's 2-bit codes, nibbles) are packed whole bytes at a time
    and are the fastest; other widths below 8 bits go 8 codes (``bits`` bytes) at a time through an
    int64 word, widths of 16, 24 and 32 bits byte by byte, and the rest through a stream of single
    bits, which is the slowest.

    Args:
        values: integer tensor (any shape, flattened) with every entry in ``[0, 2**bits)``.
        bits: code width in bits, ``1 <= bits <= 32``.

    Returns:
        1-D ``uint8`` tensor of ``ceil(values.numel() * bits / 8)`` bytes.

    Raises:
        ValueError: if ``bits`` is out of range or a value does not fit in ``bits`` bits.

    Example::

        >>> pack_uint(torch.tensor([2, 0, 1, 2, 1]), bits=2).tolist()  # TernGrad codes: {-1, 0, 1} + 1
        [134, 64]
    """
    _check_width(bits)
    values = values.reshape(-1)
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"pack_uint needs an integer tensor, got {values.dtype}")
    n = values.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    low, high = (int(v) for v in torch.aminmax(values))
    if low < 0 or high >= 1 << bits:
        raise ValueError(f"values must lie in [0, {1 << bits}) for {bits}-bit codes, got range [{low}, {high}]")
    if bits == 1:
        return pack_bits(values)
    if 8 % bits == 0:
        return _pack_byte_aligned(values, bits)
    if bits < 8:
        return _pack_small(values, bits)
    if bits % 8 == 0:  # whole bytes per code: its big-endian bytes
        work = values.to(torch.int64)
        out = torch.empty(n, bits // 8, dtype=torch.uint8, device=values.device)
        for i in range(bits // 8):
            out[:, i] = (work >> (bits - 8 * (i + 1))) & 0xFF
        return out.view(-1)
    return pack_bits(_to_bit_matrix(values, bits).reshape(-1))


def unpack_uint(packed: Tensor, bits: int, n: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """Inverse of :func:`pack_uint`: the first ``n`` codes of width ``bits``.

    Args:
        packed: 1-D ``uint8`` tensor written by :func:`pack_uint`.
        bits: code width in bits, ``1 <= bits <= 32``.
        n: number of codes, at most ``8 * packed.numel() // bits``.
        dtype: integer dtype of the result; it must hold ``bits``-bit unsigned values (``uint8`` for
            up to 8 bits saves memory on huge tensors).

    Returns:
        1-D tensor of ``n`` codes in ``[0, 2**bits)``.
    """
    _check_width(bits)
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"unpack_uint returns integers, got dtype {dtype}")
    capacity = torch.iinfo(dtype).bits - (1 if torch.iinfo(dtype).min < 0 else 0)
    if bits > capacity:
        raise ValueError(f"{dtype} cannot hold {bits}-bit unsigned codes")
    packed = check_packed(packed, n * bits)
    if n == 0:
        return torch.empty(0, dtype=dtype, device=packed.device)
    if bits == 1:
        return unpack_bits(packed, n).to(dtype)
    if 8 % bits == 0:
        return _unpack_byte_aligned(packed, bits, n).to(dtype)
    if bits < 8:
        return _unpack_small(packed, bits, n, dtype)
    if bits % 8 == 0:
        rows = packed[: n * bits // 8].view(n, bits // 8)
        out = torch.zeros(n, dtype=dtype, device=packed.device)
        for i in range(bits // 8):
            out |= rows[:, i].to(dtype) << (bits - 8 * (i + 1))
        return out
    columns = unpack_bits(packed, n * bits).view(n, bits)
    out = torch.zeros(n, dtype=dtype, device=packed.device)
    for j in range(bits):  # one vectorized pass per bit position, not per value
        out |= columns[:, j].to(dtype) << (bits - 1 - j)
    return out


def byte_table(values: Tensor, bits: int) -> Tensor:
    """``values[code]`` for each of the ``8 // bits`` codes packed in every byte value: ``(256, 8 // bits)``.

    For :func:`decode_bytes`; ``bits`` must divide 8 and ``values`` hold one entry per code.
    Unpacking the 256 byte values with :func:`unpack_uint` keeps the layout in one place.
    """
    if 8 % bits:
        raise ValueError(f"a byte holds whole codes only for widths dividing 8, got {bits}")
    per_byte = 8 // bits
    codes = unpack_uint(torch.arange(256, dtype=torch.uint8, device=values.device), bits, 256 * per_byte)
    return values[codes].view(256, per_byte)


def decode_bytes(packed: Tensor, table: Tensor, n: int, out: Tensor) -> Tensor:
    """The values of the first ``n`` codes of ``packed``, looked up a byte at a time in ``table``, into ``out``.

    ``table`` is :func:`byte_table`'s (on ``out``'s device and dtype): one lookup per byte gives all
    its codes' values, several times faster than unpacking to codes and converting them.
    """
    per_byte = table.shape[1]
    full = n // per_byte
    packed = packed.contiguous()
    if full:
        torch.index_select(table, 0, packed[:full].int(), out=out[: full * per_byte].view(full, per_byte))
    if n > full * per_byte:
        out[full * per_byte : n].copy_(table[packed[full].long()][: n - full * per_byte])
    return out


def _check_width(bits: int) -> None:
    if not 1 <= bits <= MAX_UINT_BITS:
        raise ValueError(f"code width must be in [1, {MAX_UINT_BITS}] bits, got {bits}")


def check_packed(packed: Tensor, n: int) -> Tensor:
    """``packed`` (contiguous) if it is a 1-D ``uint8`` tensor holding at least ``n`` bits, else a ValueError."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed bits must be a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    if not 0 <= n <= 8 * packed.numel():
        raise ValueError(f"cannot read {n} bits from {packed.numel()} bytes")
    return packed.contiguous()


def _to_bit_matrix(values: Tensor, bits: int) -> Tensor:
    """``(n, bits)`` uint8 matrix of 0/1, most significant bit in column 0."""
    work = values.to(torch.int64 if bits > 31 else torch.int32)
    matrix = torch.empty(values.numel(), bits, dtype=torch.uint8, device=values.device)
    for j in range(bits):  # one vectorized pass per bit position, not per value
        matrix[:, j] = (work >> (bits - 1 - j)) & 1
    return matrix


def _pack_byte_aligned(values: Tensor, bits: int) -> Tensor:
    """Pack codes whose width divides 8 (2, 4, 8): ``8 // bits`` codes per byte, all in uint8."""
    values = values.to(torch.uint8).contiguous()
    per_byte = 8 // bits
    if per_byte == 1:
        return values.clone()
    n = values.numel()
    if n % per_byte:
        values = torch.cat([values, values.new_zeros(per_byte - n % per_byte)])
    groups = values.view(-1, per_byte)
    out = groups[:, 0] << (8 - bits)
    for j in range(1, per_byte):
        out |= groups[:, j] << (8 - bits * (j + 1))
    return out


def _unpack_byte_aligned(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`_pack_byte_aligned`, as uint8."""
    if bits == 8:
        return packed[:n].clone()
    shifts = torch.arange(8 - bits, -1, -bits, device=packed.device).to(torch.uint8)
    codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.view(-1)[:n]


def _pack_small(values: Tensor, bits: int) -> Tensor:
    """Pack codes of ``bits <= 8`` bits: every 8 codes fill exactly ``bits`` bytes.

    The 8 codes of a group are gathered into one int64 (``8 * bits <= 64`` bits), whose low
    ``8 * bits`` bits are then cut into bytes, most significant first.
    """
    n = values.numel()
    values = values.to(torch.uint8).contiguous()
    if n % 8:
        values = torch.cat([values, values.new_zeros(8 - n % 8)])
    groups = values.view(-1, 8)
    word = groups[:, 0].to(torch.int64) << (7 * bits)
    for j in range(1, 8):
        word |= groups[:, j].to(torch.int64) << ((7 - j) * bits)
    out = torch.empty(groups.shape[0], bits, dtype=torch.uint8, device=values.device)
    for i in range(bits):
        out[:, i] = (word >> (8 * (bits - 1 - i))) & 0xFF
    return out.view(-1)[: packed_nbytes(n * bits)]


def _unpack_small(packed: Tensor, bits: int, n: int, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`_pack_small`."""
    groups = -(-n // 8)
    needed = groups * bits
    if packed.numel() < needed:
        packed = torch.cat([packed, packed.new_zeros(needed - packed.numel())])
    rows = packed[:needed].view(groups, bits)
    word = rows[:, 0].to(torch.int64) << (8 * (bits - 1))
    for i in range(1, bits):
        word |= rows[:, i].to(torch.int64) << (8 * (bits - 1 - i))
    out = torch.empty(groups, 8, dtype=dtype, device=packed.device)
    for j in range(8):
        out[:, j] = (word >> ((7 - j) * bits)) & ((1 << bits) - 1)
    return out.view(-1)[:n]


def _pack_bits_torch(bits: Tensor) -> Tensor:
    """Device-agnostic :func:`pack_bits` (used off the CPU, and in tests)."""
    return _pack_small(bits != 0, 1)


def _unpack_bits_torch(packed: Tensor, n: int) -> Tensor:
    """Device-agnostic :func:`unpack_bits` (used off the CPU, and in tests)."""
    return _unpack_small(packed, 1, n, torch.bool)
