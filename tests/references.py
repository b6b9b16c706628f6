"""Pieces of the reference code that several tests transcribe (compared against lgc, never imported by it)."""

from __future__ import annotations

__all__ = ["get_smaller_split"]


def get_smaller_split(n: int, close_to: int) -> int:
    """``_get_smaller_split``, the same in bloc97/DeMo ``demo.py`` and tplr-ai/templar ``src/tplr/compress.py``.

    The divisors of ``n`` in increasing order (the references build them from the prime factors);
    the first equal to ``close_to`` is returned, else the one before the first larger, else ``n``.
    """
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for index, value in enumerate(divisors):
        if value == close_to:
            return value
        if value > close_to:
            return value if index == 0 else divisors[index - 1]
    return n
