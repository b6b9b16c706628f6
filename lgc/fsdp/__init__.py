"""Gradient compression under FSDP2 (:func:`torch.distributed.fsdp.fully_shard`).

:func:`lgc.compress` takes an FSDP2 model as it takes a DDP one; this package is what it installs:
a compressed reduce-scatter per parameter group (:mod:`lgc.fsdp.reduce_scatter`), which rebuilds
each gradient whole from FSDP2's reduce-scatter input (:mod:`lgc.fsdp.layout`) and compresses it as
the DDP hook does. :class:`~lgc.fsdp.checkpoint.PerRankState` puts its state in a distributed
checkpoint (DCP), every rank's under its own key. Under hybrid sharding the local-step family
(communication delay: SBC, DiLoCo, SparseLoCo, Streaming DiLoCo) runs with the replicas as its
workers (:mod:`lgc.fsdp.local_steps`), and LGC's family codes the all-reduce across replicas, one
codec per shard position (:mod:`lgc.fsdp.learned`).
"""

from lgc.fsdp.blocks import shard_blocks, shard_model
from lgc.fsdp.checkpoint import PerRankState
from lgc.fsdp.layout import GroupLayout, ParamColumns
from lgc.fsdp.learned import HybridLGC, check_learned
from lgc.fsdp.local_steps import check_local_steps, register_local_steps, shard_rows
from lgc.fsdp.reduce_scatter import CompressedReduceScatter, FSDPCompression, check_fsdp_state, fsdp_modules
from lgc.fsdp.register import check_sharded, register_sharded
from lgc.fsdp.settings import check_fsdp_settings, replicate_group_of

__all__ = [
    "CompressedReduceScatter",
    "FSDPCompression",
    "GroupLayout",
    "HybridLGC",
    "ParamColumns",
    "PerRankState",
    "check_fsdp_settings",
    "check_fsdp_state",
    "check_learned",
    "check_local_steps",
    "check_sharded",
    "fsdp_modules",
    "register_local_steps",
    "register_sharded",
    "replicate_group_of",
    "shard_blocks",
    "shard_model",
    "shard_rows",
]
