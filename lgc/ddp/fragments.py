"""Fragments of a model's parameters for Streaming DiLoCo: when each is exchanged, and how the parameters are cut.

Douillard et al., "Streaming DiLoCo with overlapping communication" (2025): with ``fragments = F
> 1`` the parameters are cut into ``F`` fragments of about equal size (by element count,
:func:`split_into_fragments`), and fragment ``f`` is exchanged on the local steps ``t`` with ``t %
delay == (f + 1) * delay // F % delay`` (:class:`FragmentSchedule`): every fragment still waits
``delay`` steps between its exchanges, so the bytes per ``delay`` steps are unchanged, but they are
spread over ``F`` exchanges instead of one burst, and the peak bandwidth falls by about ``F``. The
outer optimizer steps only the exchanged fragment. When ``F`` divides ``delay`` this is torchft's
schedule (``DiLoCo._step_post_hook``: every ``delay / F`` local steps one fragment, fragment ``n %
F`` at the ``n``-th); torchft refuses other ``F``, where lgc keeps the formula above (torchft's
``fragment_sync_offset``), so the gaps between consecutive fragments differ by a step. A skipped
exchange keeps the schedule: its fragment waits for its next turn, where torchft, whose fragment
counter counts committed syncs, would retry the same fragment ``delay / F`` steps later and shift
the later ones. ``fragment_split`` says how the parameters are cut:

* ``"strided"`` (default; the paper's strided pattern): the parameters, and pieces of those too
  large to balance the fragments, are dealt out largest first to the fragment with the fewest
  entries, so layers of equal size go round-robin as the paper's every ``F``-th transformer block.
* ``"contiguous"``: ``F`` consecutive ranges of about equal size (the paper's sequential pattern).

Either way a parameter is cut only where balance needs it, and then only between rows of its
``(out, in * kh * kw)`` matrix: every fragment holds at most ``1.25 * total / F`` entries (1.00 to
1.16 times ``total / F`` on ResNet-8, -20 and -50 at 2 to 8 fragments), none is empty, and a
parameter that straddles a cut is exchanged in pieces (:class:`FragmentSlice`), keyed
``name[start:stop]`` (its rows ``start:stop``) in the compressor's state and the per-layer table,
and attached to the compressor as a view of those rows, so a compressor that tiles by shape tiles
each piece as a matrix (whole parameters keep their names). Where this departs from the paper and
torchft: they assign whole transformer blocks (torchft: the modules the user passes), which are of
equal size; a CNN's layers are not (ResNet-8's two largest convolutions hold 73 % of its weights),
so balanced fragments may cut inside tensors, and they are balanced by size rather than spread over
the depth.

``overlap_steps = tau`` (the paper's overlap, torchft's ``fragment_sync_delay``) starts a fragment's
exchange ``tau`` local steps before its turn (:meth:`FragmentSchedule.starting`) and applies it at
its turn (:meth:`FragmentSchedule.due`), so the exchange runs while those ``tau`` steps compute
(:mod:`lgc.ddp.streaming`). As torchft, ``tau`` is below the gap between two fragments' turns
(``delay / F`` when ``F`` divides ``delay``), so one exchange at most is in flight. The paper's
4-bit outer gradients are a compressor (:class:`lgc.compressors.FP4Compressor`,
``experiment=streaming_diloco``).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor

__all__ = [
    "FRAGMENT_BALANCE",
    "FRAGMENT_SPLITS",
    "FragmentSchedule",
    "FragmentSlice",
    "read_piece",
    "split_into_fragments",
    "write_piece",
]

#: ``fragment_split`` choices (the module docstring); the first is the default.
FRAGMENT_SPLITS = ("strided", "contiguous")
#: The most entries a fragment holds, as a multiple of an equal share ``total / F``, where rows are fine enough.
FRAGMENT_BALANCE = 1.25


class FragmentSlice(NamedTuple):
    """Rows ``start:stop`` of parameter ``name`` (along its first dimension), exchanged with fragment ``fragment``."""

    name: str
    start: int
    stop: int
    fragment: int
    #: Whether the slice is the whole parameter (its key is then the parameter's name).
    whole: bool
    #: The slice's shape: the parameter's, with ``stop - start`` rows.
    shape: tuple[int, ...]
    #: Under FSDP2, where ``start:stop`` are rows of this rank's shard: the rows of the whole parameter that the
    #: piece is this shard's part of (they name it, the same on every rank); None: ``start:stop`` name it.
    origin: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def full_numel(self) -> int:
        """Entries of the piece this slice is a shard's part of (under FSDP2), else its own: what ``min_numel`` sees."""
        if self.origin is None:
            return self.numel
        return (self.origin[1] - self.origin[0]) * math.prod(self.shape[1:])

    @property
    def entries(self) -> slice:
        """The slice's entries in the flattened (row-major) parameter."""
        row = math.prod(self.shape[1:])
        return slice(self.start * row, self.stop * row)

    @property
    def key(self) -> str:
        """The slice's name in the compressor's state, the synchronized weights and the per-layer table.

        A piece is keyed ``name[start:stop]``: ``param[start:stop]`` is its view of the parameter.
        """
        if self.whole:
            return self.name
        start, stop = self.origin or (self.start, self.stop)
        return f"{self.name}[{start}:{stop}]"

    def in_shard(self, first: int, rows: int) -> FragmentSlice:
        """This slice's part of the shard holding the parameter's rows ``first : first + rows`` (FSDP2's dim-0
        chunk), in the shard's rows, keyed as this slice: the whole shard for a whole parameter, else the rows
        the two share (none, where they share none)."""
        if self.whole:
            return self._replace(stop=rows, shape=(rows, *self.shape[1:]), origin=(self.start, self.stop))
        start = min(max(self.start - first, 0), rows)
        stop = max(min(self.stop - first, rows), start)
        return self._replace(
            start=start, stop=stop, shape=(stop - start, *self.shape[1:]), origin=(self.start, self.stop)
        )


def read_piece(param: Tensor, piece: FragmentSlice) -> Tensor:
    """The weights of ``piece``: a view of the parameter, or of its rows ``start:stop``."""
    return param.detach() if piece.whole else param.detach()[piece.start : piece.stop]


def write_piece(param: Tensor, piece: FragmentSlice, values: Tensor) -> None:
    """Copy ``values`` (of the piece's shape) into the entries of ``param`` that ``piece`` covers."""
    (param if piece.whole else param[piece.start : piece.stop]).copy_(values)


def _rows(shape: tuple[int, ...]) -> int:
    """Rows of a parameter's matrix view ``(out, in * kh * kw)``: a vector's entries, one for a scalar."""
    return shape[0] if shape else 1


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class _Piece(NamedTuple):
    """Rows ``start:stop`` of the parameter ``index`` (``numel`` entries), on their way to a fragment."""

    index: int
    start: int
    stop: int
    numel: int


def _equal_pieces(index: int, shape: tuple[int, ...], cap: float) -> list[_Piece]:
    """The parameter whole if it has at most ``cap`` entries, else in the fewest equal pieces of rows within it."""
    numel, rows = math.prod(shape), _rows(shape)
    if numel <= cap or rows == 1:
        return [_Piece(index, 0, rows, numel)]
    # The fewest pieces m that divide the rows (a single row each when none is small enough).
    m = next((d for d in _divisors(rows)[1:] if numel / d <= cap), rows)
    step = rows // m
    return [_Piece(index, j * step, (j + 1) * step, numel // m) for j in range(m)]


def _strided(shapes: list[tuple[int, ...]], fragments: int) -> list[tuple[_Piece, int]]:
    """Pieces dealt out largest first, each to the fragment with the fewest entries so far.

    A parameter is cut only when it holds more than ``cap`` entries; ``cap`` starts at an equal
    share ``total / fragments`` and halves until the fragments are within :data:`FRAGMENT_BALANCE`
    of it (list scheduling puts at most ``cap`` above the share), so small models cut as few
    tensors as balance allows.
    """
    share = sum(math.prod(shape) for shape in shapes) / fragments
    cap = share
    while True:
        pieces = [piece for index, shape in enumerate(shapes) for piece in _equal_pieces(index, shape, cap)]
        loads = [(0, fragment) for fragment in range(fragments)]  # a heap: the fewest entries, then the lowest index
        owners = [0] * len(pieces)
        # Largest first; equal sizes in model order (sorted is stable), so equal layers go round-robin.
        for i in sorted(range(len(pieces)), key=lambda i: -pieces[i].numel):
            load, fragment = heapq.heappop(loads)
            owners[i] = fragment
            heapq.heappush(loads, (load + pieces[i].numel, fragment))
        filled = sum(1 for piece in pieces if piece.numel) >= fragments
        if filled and max(load for load, _ in loads) <= FRAGMENT_BALANCE * share or cap < 1:
            return list(zip(pieces, owners, strict=True))
        cap /= 2


def _contiguous(shapes: list[tuple[int, ...]], fragments: int) -> list[tuple[_Piece, int]]:
    """``fragments`` consecutive ranges of the flattened parameters, cut near ``f * total / fragments``.

    A cut moves onto a boundary between parameters within ``slack`` (half of the balance's margin),
    else onto the first piece boundary within it of the parameter cut into ``m`` equal pieces (the
    smallest ``m`` dividing its rows), else onto the nearest row boundary.
    """
    numels = [math.prod(shape) for shape in shapes]
    ends = list(itertools.accumulate(numels))
    total = ends[-1]
    slack = total * (FRAGMENT_BALANCE - 1) / (2 * fragments)
    # Every place a cut may fall: a boundary between rows (or between parameters), in order.
    boundaries = [0]
    for shape, numel, end in zip(shapes, numels, ends, strict=True):
        if numel:
            row = numel // _rows(shape)
            boundaries.extend(range(end - numel + row, end + 1, row))
    cuts = []
    for f in range(1, fragments):
        ideal = f * total / fragments
        index = bisect.bisect_right(ends, ideal)
        start, numel, rows = ends[index] - numels[index], numels[index], _rows(shapes[index])
        position = min((start, ends[index]), key=lambda edge: abs(edge - ideal))
        if abs(position - ideal) > slack:
            steps = (numel // m for m in _divisors(rows)[1:])
            near = (start + round((ideal - start) / step) * step for step in steps)
            position = next((p for p in near if abs(p - ideal) <= slack), None)
            if position is None:
                row = numel // rows
                position = start + round((ideal - start) / row) * row
        cuts.append(bisect.bisect_left(boundaries, position))
    # Non-empty ranges (every fragment at least one row: there are at least as many rows as fragments).
    for f in range(len(cuts)):
        cuts[f] = max(cuts[f], cuts[f - 1] + 1 if f else 1)
    for f in reversed(range(len(cuts))):
        cuts[f] = min(cuts[f], (cuts[f + 1] if f + 1 < len(cuts) else len(boundaries) - 1) - 1)
    bounds = [0, *(boundaries[c] for c in cuts), total]
    pieces = []
    for index, (shape, numel, end) in enumerate(zip(shapes, numels, ends, strict=True)):
        start, row = end - numel, numel // _rows(shape)
        inside = [b for b in bounds if start < b < end]  # none in an empty parameter
        rows = [0, *((b - start) // row for b in inside), _rows(shape)]
        for a, b in itertools.pairwise(rows):
            pieces.append((_Piece(index, a, b, (b - a) * row), bisect.bisect_right(bounds, start + a * row) - 1))
    return pieces


def split_into_fragments(
    shapes: Sequence[tuple[str, Sequence[int]]], fragments: int, split: str = FRAGMENT_SPLITS[0]
) -> tuple[FragmentSlice, ...]:
    """Cut parameters (name, shape; in model order) into ``fragments`` fragments of about equal size.

    A parameter is cut only between rows of its matrix view ``(out, in * kh * kw)`` (a vector
    between entries), so every piece is the parameter's rows ``start:stop``: a tensor of the same
    dimensions, and the matrix ``(stop - start, in * kh * kw)`` to a compressor that tiles by shape.

    * ``"strided"``: every parameter with more entries than ``cap`` is cut into the fewest equal
      pieces (a number that divides its rows) of at most ``cap`` entries; the pieces are dealt out
      largest first, each to the fragment with the fewest entries so far (ties: model order, then
      the lowest fragment). ``cap`` starts at an equal share ``total / fragments`` and halves until
      no fragment holds more than :data:`FRAGMENT_BALANCE` times the share, so as few tensors are
      cut as balance allows. Layers of equal size go round-robin: block ``b`` of a stack of equal
      blocks (a transformer's) lands in fragment ``b % fragments``, the paper's strided pattern. A
      CNN's layers differ in size, and its fragments are balanced by size rather than spread over
      the depth: a fragment can hold a few of the largest layers only (ResNet-8 at 2 fragments: its
      largest convolution and a few vectors, against everything else).
    * ``"contiguous"``: ``fragments`` consecutive ranges, cut near ``f * total / fragments``. A cut
      moves onto a boundary between parameters within half the balance's margin
      (``0.125 * total / fragments``), so small tensors stay whole; else onto a multiple of
      ``rows / m`` rows within that margin, for the smallest ``m`` dividing the parameter's rows;
      else onto the nearest row.

    Either way a fragment holds at most ``1.25 * total / fragments`` entries where the rows are
    fine enough (1.00 to 1.16 times it on ResNet-8, -20 and -50 at 2 to 8 fragments, up to 1.22 at
    16), and none is empty.

    Tiles (:mod:`lgc.compressors.tiles`): a piece of ``r`` rows is tiled as its own matrix,
    ``split(r) x split(cols)``: its columns as the whole tensor's, its rows by ``split(r)``, which
    may differ from the whole tensor's ``split(out)``. Pieces of ``out / m`` rows hold whole tiles
    of the tensor when ``out / m`` is a multiple of ``split(out)``, and a tiled compressor then
    keeps as many entries of the pieces as of the whole tensor (SparseLoCo on ResNet-50: the same
    count at 2 to 16 strided fragments, 1.01 times it at 16 contiguous ones). A tensor of at most
    ``chunk`` rows is one row of tiles, and so is each of its pieces: cut in ``m``, it keeps ``m``
    times as many. SparseLoCo on ResNet-8 keeps the same 2,538 entries per ``delay`` steps at 2
    fragments (no tensor is cut) and 1.23, 1.83 and 3.19 times as many at 4, 8 and 16, which cut
    its largest convolutions.

    Returns:
        The pieces in parameter order; a parameter in one fragment is one whole piece.

    Raises:
        ValueError: an unknown ``split``, or fewer rows (entries of vectors) than ``fragments``.
    """
    if split not in FRAGMENT_SPLITS:
        raise ValueError(f"fragment_split must be one of {FRAGMENT_SPLITS}, got {split!r}")
    names = [name for name, _ in shapes]
    dims = [tuple(int(n) for n in shape) for _, shape in shapes]
    rows = sum(_rows(shape) for shape in dims if math.prod(shape))
    if fragments > rows:
        raise ValueError(
            f"fragments={fragments} is more than the model's {rows} rows of trainable weights (a fragment holds "
            "whole rows of a parameter's (out, in * kh * kw) matrix, or entries of a vector): every fragment needs "
            "at least one"
        )
    dealt = (_strided if split == "strided" else _contiguous)(dims, fragments)
    # In parameter order; neighbouring rows of one parameter in one fragment become one piece.
    merged: list[_Piece | None] = []
    owners: list[int] = []
    for piece, fragment in sorted(dealt, key=lambda item: (item[0].index, item[0].start)):
        last = merged[-1] if merged else None
        if last is not None and last.index == piece.index and owners[-1] == fragment:
            merged[-1] = _Piece(piece.index, last.start, piece.stop, last.numel + piece.numel)
        else:
            merged.append(piece)
            owners.append(fragment)
    slices = []
    for piece, fragment in zip(merged, owners, strict=True):
        shape = dims[piece.index]
        whole = piece.start == 0 and piece.stop == _rows(shape)
        part = shape if whole or not shape else (piece.stop - piece.start, *shape[1:])
        slices.append(FragmentSlice(names[piece.index], piece.start, piece.stop, fragment, whole, part))
    return tuple(slices)


class FragmentSchedule:
    """When each of ``fragments`` fragments is exchanged within every ``delay`` local steps, and how they are cut.

    Args:
        delay: local steps between two exchanges of the same fragment.
        fragments: how many (1: every parameter at once, every ``delay`` steps); at most ``delay``,
            each fragment its own step.
        split: ``"strided"`` or ``"contiguous"`` (the module docstring).
        overlap_steps: local steps between the start of a fragment's exchange and its turn, below
            the shortest gap between two turns (:attr:`shortest_gap`; 0: the exchange blocks at its turn).
    """

    __slots__ = ("delay", "fragments", "overlap_steps", "split")

    def __init__(self, delay: int, fragments: int = 1, split: str = FRAGMENT_SPLITS[0], overlap_steps: int = 0) -> None:
        if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= delay:
            raise ValueError(
                f"fragments must be an integer from 1 to delay={delay} (each fragment is exchanged on a step of its "
                f"own), got {fragments!r}"
            )
        if split not in FRAGMENT_SPLITS:
            raise ValueError(f"fragment_split must be one of {FRAGMENT_SPLITS}, got {split!r}")
        self.delay, self.fragments, self.split = delay, fragments, split
        gap = self.shortest_gap
        if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or not 0 <= overlap_steps < gap:
            raise ValueError(
                f"overlap_steps must be an integer from 0 to {gap - 1}, below the {gap} local steps between two "
                f"fragments' exchanges (delay={delay}, fragments={fragments}): a fragment's exchange must be applied "
                f"before the next one starts; got {overlap_steps!r}"
            )
        self.overlap_steps = overlap_steps

    @property
    def shortest_gap(self) -> int:
        """The fewest local steps between two consecutive exchanges (``delay // fragments``)."""
        turns = sorted(self.step_of(f) or self.delay for f in range(self.fragments))
        return min(b - a for a, b in zip([turns[-1] - self.delay, *turns], turns, strict=False))

    def step_of(self, fragment: int) -> int:
        """The step within every ``delay`` local steps (``0`` for the last) at which ``fragment`` is exchanged."""
        return (fragment + 1) * self.delay // self.fragments % self.delay

    def due(self, local_step: int) -> list[int]:
        """The fragments exchanged after local step ``local_step`` (counted from 1), in schedule order."""
        return [f for f in range(self.fragments) if local_step % self.delay == self.step_of(f)]

    def starting(self, local_step: int) -> list[int]:
        """The fragments whose exchange starts after local step ``local_step``: :meth:`due` ``overlap_steps`` later."""
        return self.due(local_step + self.overlap_steps)

    def exchanges_through(self, step: int) -> int:
        """Exchanges (of a fragment, or of everything) due on local steps ``1..step``, skipped ones included."""
        total = 0
        for fragment in range(self.fragments):
            first = self.step_of(fragment) or self.delay
            if step >= first:
                total += (step - first) // self.delay + 1
        return total

    def slices_of(self, trainable: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[FragmentSlice, ...]:
        """The fragments' pieces of the trainable parameters ``(name, shape)`` (:func:`split_into_fragments`)."""
        return split_into_fragments(list(trainable), self.fragments, self.split)
