"""Checks of a dataset's folder layout that name the missing or mismatching path."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["require_files", "require_folder"]


def require_folder(root: str | Path, what: str) -> Path:
    """``root`` as a Path, or a clear error naming it when it is not an existing folder."""
    path = Path(root).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{what} data folder {str(path)!r} does not exist; set data.root to the dataset folder")
    return path


def require_files(folder: Path, names: Iterable[str], what: str) -> None:
    """A clear error naming the first of ``names`` that is not a file in ``folder``."""
    for name in names:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{what} file {str(folder / name)!r} does not exist")
