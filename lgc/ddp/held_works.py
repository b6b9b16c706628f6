"""The handles of the last collectives, held so that the interpreter, not gloo's thread, frees them.

gloo's worker thread drops its reference to a work after marking it complete. If that is the last
reference, the thread frees the work's tensors, which takes the interpreter's lock; at the end of a
program the interpreter may already be shutting down then, and the process aborts after its work is
done ("terminate called without an active exception": 7 of 108 runs of the README's two-worker
example with SBC under a delay, whose last step ends in an allgather; none of 140 runs of it and of
its top-k and LGC-RAR variants with the handles held). Every collective of
:mod:`lgc.ddp.collectives` passes its work through :func:`kept`, which holds the last
:data:`HELD` of them: the last reference is then the interpreter's own. At most that many
collectives' tensors outlive their step.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, TypeVar

__all__ = ["HELD", "kept"]

#: How many of the latest works are held.
HELD = 16

_recent: deque[Any] = deque(maxlen=HELD)
#: What a forked child inherited of its parent's handles, never released there: their process group
#: is the parent's, and destroying them in the child can block forever on its copied locks.
_parents: list[deque[Any]] = []

Work = TypeVar("Work")


def kept(work: Work) -> Work:
    """``work``, held until :data:`HELD` later collectives have been issued."""
    _recent.append(work)
    return work


def _forget_parents_works() -> None:
    global _recent
    _parents.append(_recent)
    _recent = deque(maxlen=HELD)


os.register_at_fork(after_in_child=_forget_parents_works)
