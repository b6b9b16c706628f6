"""Unit tests of the bit-level codecs: Golomb-Rice position coding (SBC) and bit packing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lgc.coding import (
    HEADER_BYTES,
    GolombCode,
    binary_entropy_bits_per_position,
    bitpack,
    expected_bits_per_position,
    golomb,
    golomb_decode,
    golomb_decode_segments,
    golomb_encode,
    golomb_encode_segments,
    optimal_golomb_parameter,
    pack_bits,
    pack_uint,
    packed_nbytes,
    unpack_bits,
    unpack_uint,
)


def _random_positions(numel: int, count: int, seed: int) -> torch.Tensor:
    """``count`` distinct positions in ``[0, numel)``, in random (unsorted) order."""
    return torch.randperm(numel, generator=torch.Generator().manual_seed(seed))[:count]


def _reference_stream(positions: list[int], b: int) -> list[int]:
    """Word-by-word Golomb-Rice encoder: all b-bit remainders, then all unary quotients."""
    remainders, unary, previous = [], [], -1
    for position in sorted(positions):
        quotient, remainder = divmod(position - previous - 1, 1 << b)
        remainders += [(remainder >> (b - 1 - j)) & 1 for j in range(b)]
        unary += [1] * quotient + [0]
        previous = position
    return remainders + unary


# --------------------------------------------------------------------------- Golomb: parameter


@pytest.mark.parametrize(
    ("p", "b_star", "expected_bits", "entropy_bits"),
    [(0.01, 6, 8.11, 8.08), (0.001, 9, 11.49, 11.41), (0.0001, 13, 14.79, 14.73)],
)
def test_sbc_parameter_and_expected_length_match_the_paper(p, b_star, expected_bits, entropy_bits):
    assert optimal_golomb_parameter(p) == b_star
    assert expected_bits_per_position(p, b_star) == pytest.approx(expected_bits, abs=0.005)
    assert binary_entropy_bits_per_position(p) == pytest.approx(entropy_bits, abs=0.005)


def test_optimal_parameter_is_the_best_rice_parameter_and_never_negative():
    for p in (0.3, 0.05, 0.01, 0.003, 0.001, 1e-4, 1e-5):
        b = optimal_golomb_parameter(p)
        costs = {c: expected_bits_per_position(p, c) for c in range(0, 30)}
        assert costs[b] == pytest.approx(min(costs.values()), rel=1e-12)
    assert [optimal_golomb_parameter(p) for p in (0.4, 0.5, 0.7, 0.99, 1.0)] == [0] * 5
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            optimal_golomb_parameter(bad)


# --------------------------------------------------------------------------- Golomb: round trips

NUMEL = 1000

CASES = {
    "empty": (NUMEL, []),
    "single_first": (NUMEL, [0]),
    "single_last": (NUMEL, [NUMEL - 1]),
    "single_middle": (NUMEL, [517]),
    "numel_one": (1, [0]),
    "first_and_last": (NUMEL, [0, NUMEL - 1]),
    "first_index_zero": (NUMEL, [0, 3, 4, 200, 999]),
    "unsorted": (NUMEL, [999, 5, 0, 64, 63, 128]),
    "all_indices": (NUMEL, list(range(NUMEL))),
    "dense_half": (NUMEL, _random_positions(NUMEL, NUMEL // 2, seed=1).tolist()),
    "sparse_random": (100_000, _random_positions(100_000, 137, seed=2).tolist()),
    "very_sparse_big_gaps": (10**9, [5, 123_456_789, 10**9 - 1]),
}


@pytest.fixture(params=["numpy", "torch"])
def golomb_path(request, monkeypatch):
    """Run a test through the CPU's numpy coder and through the torch coder used off the CPU.

    The torch coder also gets the pure-torch bit packing and sort, so on the CPU it exercises
    exactly the operations a GPU runs.
    """
    if request.param == "torch":
        monkeypatch.setattr(golomb, "_encode_numpy", golomb._encode_torch)
        monkeypatch.setattr(golomb, "_decode_numpy", golomb._decode_torch)
        monkeypatch.setattr(golomb, "pack_bits", bitpack._pack_bits_torch)
        monkeypatch.setattr(golomb, "unpack_bits", bitpack._unpack_bits_torch)
        monkeypatch.setattr(golomb, "_sort", lambda t: torch.sort(t).values)
    return request.param


@pytest.mark.parametrize("case", sorted(CASES))
def test_golomb_round_trip_is_exact(case, golomb_path):
    numel, positions = CASES[case]
    code = golomb_encode(torch.tensor(positions, dtype=torch.int64), numel)
    assert code.count == len(positions)
    assert code.bits.dtype == torch.uint8 and code.bits.numel() == packed_nbytes(code.num_bits)
    decoded = golomb_decode(code)
    assert decoded.dtype == torch.int64
    assert decoded.tolist() == sorted(positions)

    wire = code.to_wire()
    assert wire.dtype == torch.uint8 and wire.numel() == code.nbytes == HEADER_BYTES + code.bits.numel()
    rebuilt = GolombCode.from_wire(wire)
    assert (rebuilt.num_bits, rebuilt.count, rebuilt.b) == (code.num_bits, code.count, code.b)
    assert golomb_decode(rebuilt).tolist() == sorted(positions)


@pytest.mark.parametrize("case", sorted(CASES))
def test_golomb_stream_is_the_golomb_rice_code_words(case, golomb_path):
    numel, positions = CASES[case]
    if case == "very_sparse_big_gaps":
        positions = [5, 1234, 56_789]  # keep the pure-Python reference small
    code = golomb_encode(torch.tensor(positions, dtype=torch.int64), numel)
    reference = _reference_stream(positions, code.b)
    # The stream is exactly the code words (q + 1 + b bits each), no more.
    assert code.num_bits == len(reference)
    assert unpack_bits(code.bits, code.num_bits).int().tolist() == reference
    assert unpack_bits(code.bits, 8 * code.bits.numel())[code.num_bits :].sum() == 0  # zero padding


@pytest.mark.parametrize("b", [0, 1, 3, 12, 31, 40])
def test_golomb_round_trip_with_a_forced_parameter(b, golomb_path):
    positions = _random_positions(5000, 300, seed=b)
    code = golomb_encode(positions, 5000, b=b)
    assert code.b == b
    gaps = torch.diff(positions.sort().values, prepend=torch.tensor([-1]))
    assert code.num_bits == int(((gaps - 1) >> b).sum()) + len(positions) * (b + 1)
    assert torch.equal(golomb_decode(GolombCode.from_wire(code.to_wire())), positions.sort().values)


def test_golomb_accepts_int32_and_shaped_indices():
    positions = _random_positions(4096, 64, seed=3)
    expected = golomb_decode(golomb_encode(positions, 4096))
    assert torch.equal(golomb_decode(golomb_encode(positions.int().view(8, 8), 4096)), expected)


def test_golomb_rejects_bad_input(golomb_path):
    with pytest.raises(ValueError, match="distinct"):
        golomb_encode(torch.tensor([3, 7, 3]), 10)
    with pytest.raises(ValueError, match="lie in"):
        golomb_encode(torch.tensor([3, 10]), 10)
    with pytest.raises(ValueError, match="lie in"):
        golomb_encode(torch.tensor([-1, 4]), 10)
    with pytest.raises(ValueError, match="integer"):
        golomb_encode(torch.tensor([1.0, 2.0]), 10)
    with pytest.raises(ValueError, match="Rice parameter"):
        golomb_encode(torch.tensor([1, 2]), 10, b=-1)


def test_golomb_decode_refuses_a_code_whose_bits_do_not_hold_its_stream(golomb_path):
    bits = torch.tensor([0xFF], dtype=torch.uint8)
    with pytest.raises(ValueError, match="cannot read 9 bits from 1 bytes"):
        golomb_decode(GolombCode(bits=bits, num_bits=9, count=1, b=0))
    with pytest.raises(ValueError, match="1-D uint8"):
        golomb_decode(GolombCode(bits=bits.view(1, 1), num_bits=8, count=1, b=0))
    with pytest.raises(ValueError, match="1-D uint8"):
        golomb_decode(GolombCode(bits=bits.to(torch.int16), num_bits=8, count=1, b=0))


def test_golomb_from_wire_rejects_corrupt_buffers(golomb_path):
    wire = golomb_encode(_random_positions(10_000, 100, seed=4), 10_000).to_wire()
    with pytest.raises(ValueError):
        GolombCode.from_wire(wire[:3])
    with pytest.raises(ValueError, match="corrupt"):
        GolombCode.from_wire(wire[:-1])
    with pytest.raises(ValueError, match="corrupt"):
        GolombCode.from_wire(torch.cat([wire, torch.zeros(1, dtype=torch.uint8)]))


def test_golomb_wire_of_a_slice_of_a_gathered_buffer(golomb_path):
    codes = [golomb_encode(_random_positions(20_000, k, seed=k), 20_000) for k in (0, 1, 33, 800)]
    gathered = torch.cat([c.to_wire() for c in codes])  # what an allgather of variable sizes yields
    offset = 0
    for code in codes:
        rebuilt = GolombCode.from_wire(gathered[offset : offset + code.nbytes])
        assert torch.equal(golomb_decode(rebuilt), golomb_decode(code))
        offset += code.nbytes


@pytest.mark.parametrize("b", [None, 0, 1, 5, 31, 33])
@pytest.mark.parametrize("case", sorted(CASES))
def test_golomb_numpy_and_torch_coders_write_the_same_stream(case, b):
    numel, positions = CASES[case]
    if not positions:
        return
    tensor = torch.tensor(positions, dtype=torch.int64)
    b = golomb.optimal_golomb_parameter(len(positions) / numel) if b is None else b
    if case == "very_sparse_big_gaps" and b < 20:
        b = 20  # gaps of 10**8 in unary at small b: a gigabit stream
    bits, num_bits = golomb._encode_numpy(tensor, numel, b)
    torch_bits, torch_num_bits = golomb._encode_torch(tensor, numel, b)
    assert num_bits == torch_num_bits and torch.equal(bits, torch_bits)
    decoded = golomb._decode_numpy(bits, num_bits, len(positions), b)
    assert decoded.dtype == torch.int64 and decoded.tolist() == sorted(positions)
    assert torch.equal(golomb._decode_torch(bits, num_bits, len(positions), b), decoded)


# --------------------------------------------------------------------------- Golomb: code length


@pytest.mark.parametrize(("p", "numel"), [(0.01, 4_000_000), (0.001, 8_000_000), (0.0001, 10_000_000)])
def test_golomb_bits_per_position_match_formula_and_entropy_bound(p, numel):
    # Each position kept independently with probability p: the gaps are exactly geometric, the
    # model behind SBC's formula (about 40000, 8000 and 1000 positions).
    generator = torch.Generator().manual_seed(0)
    positions = torch.nonzero(torch.rand(numel, generator=generator) < p).squeeze(1)
    code = golomb_encode(positions, numel)
    b_star = optimal_golomb_parameter(p)
    assert code.b == b_star
    measured = code.bits_per_position
    assert measured == pytest.approx(expected_bits_per_position(p, b_star), rel=0.01)
    assert measured == pytest.approx(binary_entropy_bits_per_position(p), rel=0.02)
    assert measured < 32 / 2  # at least twice as small as raw int32 indices
    assert torch.equal(golomb_decode(code), positions)


# --------------------------------------------------------------------------- bit packing

LENGTHS = [0, 1, 7, 8, 9, 63, 1001]


@pytest.mark.parametrize("n", LENGTHS)
def test_pack_bits_round_trip(n):
    generator = torch.Generator().manual_seed(n)
    bits = torch.rand(n, generator=generator) < 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    assert torch.equal(unpack_bits(packed, n), bits)
    assert torch.equal(pack_bits(bits.to(torch.uint8)), packed)  # 0/1 uint8 input
    assert torch.equal(bitpack._pack_bits_torch(bits), packed)
    assert torch.equal(bitpack._unpack_bits_torch(packed, n), bits)


def test_pack_bits_layout_is_msb_first():
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [0b10110000, 0b10000000]
    with pytest.raises(ValueError):
        unpack_bits(pack_bits(bits), 17)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 24, 32])
@pytest.mark.parametrize("n", LENGTHS)
def test_pack_uint_round_trip(bits, n):
    generator = torch.Generator().manual_seed(bits * 1000 + n)
    values = torch.randint(0, 1 << bits, (n,), generator=generator, dtype=torch.int64)
    if n:
        values[0] = (1 << bits) - 1  # the largest code must survive
    packed = pack_uint(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_uint(packed, bits, n), values)
    # Same stream as writing each code's bits MSB-first one after another.
    stream = bitpack._to_bit_matrix(values, bits).reshape(-1)
    assert torch.equal(packed, pack_bits(stream))


@pytest.mark.parametrize("bits", [1, 2, 4, 6, 8])
def test_unpack_uint_into_a_small_dtype(bits):
    values = torch.randint(0, 1 << bits, (37,), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    out = unpack_uint(pack_uint(values, bits), bits, 37, dtype=torch.uint8)
    assert out.dtype == torch.uint8 and torch.equal(out, values)


def test_pack_uint_examples_and_bad_input():
    assert pack_uint(torch.tensor([2, 0, 1, 2, 1]), bits=2).tolist() == [0b10000110, 0b01000000]
    assert pack_uint(torch.tensor([5, 3]), bits=3).tolist() == [0b10101100]
    with pytest.raises(ValueError, match="lie in"):
        pack_uint(torch.tensor([4]), bits=2)
    with pytest.raises(ValueError, match="lie in"):
        pack_uint(torch.tensor([-1]), bits=4)
    with pytest.raises(ValueError, match="width"):
        pack_uint(torch.tensor([1]), bits=0)
    with pytest.raises(ValueError, match="integer"):
        pack_uint(torch.tensor([1.0]), bits=4)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_uint(torch.zeros(2, dtype=torch.uint8), 9, 1, dtype=torch.uint8)


@settings(max_examples=60, deadline=None)
@given(
    sets=st.lists(st.tuples(st.sampled_from([1, 5, 64, 1000, 50_000]), st.floats(0.0, 1.0)), min_size=1, max_size=6),
    b=st.sampled_from([None, None, 0, 3, 12]),
    seed=st.integers(0, 2**16),
)
def test_golomb_codes_of_several_sets_at_once_are_each_sets_own(sets, b, seed):
    """golomb_encode_segments: every set's wire buffer (header and stream) bit for bit golomb_encode's, empty
    sets and a forced b included; each decodes back to its positions."""
    gen = torch.Generator().manual_seed(seed)
    numels = [numel for numel, _ in sets]
    counts = [min(numel, round(fraction * min(numel, 600))) for numel, fraction in sets]
    chosen = [torch.randperm(n, generator=gen)[:c].sort().values for n, c in zip(numels, counts, strict=True)]
    wires = golomb_encode_segments(torch.cat(chosen), numels, counts, b=b)
    for positions, numel, wire in zip(chosen, numels, wires, strict=True):
        assert torch.equal(wire, golomb_encode(positions, numel, b=b).to_wire())
        assert torch.equal(golomb_decode(GolombCode.from_wire(wire)), positions)
    for positions, decoded in zip(chosen, golomb_decode_segments(wires), strict=True):
        assert torch.equal(decoded, positions)


def test_golomb_decoding_of_several_codes_at_once_checks_each_as_one_code_alone():
    """A code with a byte too many, a byte too few, or a header that claims more positions: the error
    golomb_decode gives that code alone, naming which of the codes it is."""
    good = golomb_encode(torch.tensor([3, 9, 40]), 64).to_wire()
    other = golomb_encode(torch.tensor([0, 1]), 8).to_wire()
    assert [p.tolist() for p in golomb_decode_segments([good, other])] == [[3, 9, 40], [0, 1]]
    longer = torch.cat([good, torch.zeros(1, dtype=torch.uint8)])
    claims_more = good.clone()
    claims_more[0] += 1
    for corrupt in (longer, good[:-1], claims_more):
        with pytest.raises(ValueError):
            golomb_decode(GolombCode.from_wire(corrupt))
        with pytest.raises(ValueError, match="corrupt Golomb (buffer|stream) 1"):
            golomb_decode_segments([other, corrupt])
    with pytest.raises(ValueError, match="not a 1-D uint8 tensor"):
        golomb_decode_segments([good, good[:3]])


def test_golomb_codes_of_several_sets_refuse_positions_out_of_order_or_range():
    with pytest.raises(ValueError, match="ascending, distinct and within"):
        golomb_encode_segments(torch.tensor([3, 2, 0]), [5, 4], [2, 1])
    with pytest.raises(ValueError, match="ascending, distinct and within"):
        golomb_encode_segments(torch.tensor([1, 4]), [5, 4], [1, 1])
