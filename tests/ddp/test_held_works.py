"""lgc's collectives hold the handles of their last works (lgc.ddp.held_works).

The behaviour this protects, a worker that does not abort at exit while gloo's thread frees its last
work, is run by tests/test_readme.py (the README's examples under torchrun); here: the bound, and a
forked child's separation from its parent's handles.
"""

import os

import torch
import torch.distributed as dist

from lgc.ddp import collectives, held_works
from lgc.ddp.collectives import CommStats


def test_every_collective_leaves_its_work_held_and_at_most_the_bound(group):
    stats = CommStats()
    collectives.all_reduce(stats, torch.ones(4), None).wait()
    assert isinstance(held_works._recent[-1], dist.Work)
    for _ in range(held_works.HELD + 3):
        collectives.broadcast(stats, torch.ones(2), 0, None)
    outputs, work = collectives.all_gather(stats, torch.ones(3), None)
    work.wait()
    assert held_works._recent[-1] is work
    assert len(held_works._recent) == held_works.HELD


def test_a_forked_child_sets_its_parents_handles_aside_and_never_evicts_them(group):
    collectives.all_reduce(CommStats(), torch.ones(4), None).wait()
    parents = held_works._recent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only looks, then leaves without teardown
        apart = held_works._recent is not parents and len(held_works._recent) == 0
        os.write(write, b"1" if apart and held_works._parents[-1] is parents else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert held_works._recent is parents  # the parent's own are untouched
