"""Bit-level codecs: Golomb-Rice coding of sparse positions and bit packing of small codes. Pure PyTorch."""

from lgc.coding.bitpack import pack_bits, pack_uint, packed_nbytes, unpack_bits, unpack_uint
from lgc.coding.golomb import (
    HEADER_BYTES,
    GolombCode,
    binary_entropy_bits_per_position,
    expected_bits_per_position,
    golomb_decode,
    golomb_encode,
    optimal_golomb_parameter,
)
from lgc.coding.golomb_segments import golomb_decode_segments, golomb_encode_segments

__all__ = [
    "HEADER_BYTES",
    "GolombCode",
    "binary_entropy_bits_per_position",
    "expected_bits_per_position",
    "golomb_decode",
    "golomb_decode_segments",
    "golomb_encode",
    "golomb_encode_segments",
    "optimal_golomb_parameter",
    "pack_bits",
    "pack_uint",
    "packed_nbytes",
    "unpack_bits",
    "unpack_uint",
]
