"""What :func:`lgc.compress` takes for an FSDP2 model: the DDP settings it refuses, and HSDP's replicate dimension."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

__all__ = ["DDP_ONLY", "check_fsdp_settings", "replicate_group_of"]


#: Settings of the DDP hook that an FSDP2 model does not take: FSDP2 reduces each parameter group as it is ready.
DDP_ONLY = ("overlap", "pack")


def check_fsdp_settings(settings: dict[str, Any]) -> None:
    given = [name for name in DDP_ONLY if settings.get(name) is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)}: DDP settings, which an FSDP2 model does not take (FSDP2 reduces each parameter "
            "group as it is ready, over its mesh)"
        )


def replicate_group_of(model: Any, replicate: DeviceMesh | dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``replicate``'s process group, refused unless the model is FSDP2's and it is one dimension."""
    if replicate is None:
        return None
    if not isinstance(model, FSDPModule):
        raise ValueError("replicate= is hybrid sharding's replicate dimension: it applies to FSDP2 models only")
    if isinstance(replicate, DeviceMesh):
        if replicate.ndim != 1:
            raise ValueError(
                f"replicate= takes one dimension of a mesh (mesh['replicate']), got {replicate.ndim}: {replicate}"
            )
        return replicate.get_group()
    if not isinstance(replicate, dist.ProcessGroup):
        raise TypeError(f"replicate= takes a 1-D DeviceMesh or a ProcessGroup, got {type(replicate).__name__}")
    return replicate
