"""Read an offline wandb run (``wandb/offline-run-*/run-*.wandb``) without syncing it anywhere.

``lgc-train`` logs to wandb offline by default. Before (or instead of) ``wandb sync``, this reads
the run's transaction log directly: its config, every logged step and its summary (tables
included), for a notebook or a test. The file is wandb's LevelDB-style log (a 7-byte header
``:W&B``, magic, version; then 32 KiB blocks of records, each ``crc32 | length | type | data``
with data split across blocks as FULL / FIRST / MIDDLE / LAST pieces), whose records are
``wandb_internal_pb2.Record`` protocol buffers.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["OfflineRun", "read_offline_run"]

_FILE_HEADER = 7
_BLOCK = 32768
_RECORD_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    """What an offline run recorded."""

    #: The run's config (``wandb.config``), values decoded from JSON.
    config: dict[str, Any] = field(default_factory=dict)
    #: Every ``wandb.log`` call's values, in order (``_step`` included).
    history: list[dict[str, Any]] = field(default_factory=list)
    #: The final summary (last values, tables as their JSON descriptions).
    summary: dict[str, Any] = field(default_factory=dict)
    group: str = ""
    name: str = ""

    @property
    def history_keys(self) -> set[str]:
        return {key for row in self.history for key in row}


def _records(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a wandb transaction log (no ':W&B' header)")
    records, pending, offset = [], b"", _FILE_HEADER
    while offset + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _RECORD_HEADER:  # a block's zero-filled trailer
            offset += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + _RECORD_HEADER])
        piece = data[offset + _RECORD_HEADER : offset + _RECORD_HEADER + length]
        offset += _RECORD_HEADER + length
        if kind == _FULL:
            records.append(piece)
        elif kind == _FIRST:
            pending = piece
        elif kind == _MIDDLE:
            pending += piece
        elif kind == _LAST:
            records.append(pending + piece)
            pending = b""
        elif kind == 0 and length == 0:
            offset += left_in_block - _RECORD_HEADER  # padding to the block's end
    return records


def _items(items: Any) -> dict[str, Any]:
    """Decode ``key``/``nested_key`` items (a logged dict, e.g. a Table's description, is nested)."""
    decoded: dict[str, Any] = {}
    for item in items:
        *parents, last = [item.key] if item.key else list(item.nested_key)
        node = decoded
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = json.loads(item.value_json)
    return decoded


def read_offline_run(run_dir: str | Path) -> OfflineRun:
    """Read ``run_dir`` (an ``offline-run-*`` folder, or its ``run-*.wandb`` file)."""
    from wandb.proto import wandb_internal_pb2

    path = Path(run_dir)
    files = [path] if path.is_file() else sorted(path.glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb transaction log in {str(path)!r}")
    run = OfflineRun()
    for raw in _records(files[0].read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.group, run.name = record.run.run_group, record.run.display_name
            run.config.update(_items(record.run.config.update))
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "history":
            run.history.append(_items(record.history.item))
        elif kind == "summary":
            run.summary.update(_items(record.summary.update))
    return run
