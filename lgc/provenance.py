"""Where a run's code came from: the commit it ran, whether the tree had changes, the versions.

Every ``summary.json`` records this (``provenance``), so a result can be traced to the code that
made it and runs of one comparison can be checked to share a commit. Read in the launching process
before any worker starts: the commit of the git checkout that holds the imported ``lgc`` package
(an editable install), or None where the package is not in a checkout (a wheel).
"""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["package_checkout", "run_provenance"]

#: At most this many changed paths are listed (their count is always given).
MAX_CHANGED_PATHS = 50


def package_checkout() -> Path | None:
    """The git work tree whose tracked files include the imported ``lgc`` package, or None (a wheel
    installed into a folder that happens to lie inside some other checkout is not credited to it)."""
    here = Path(__file__).resolve().parent
    top = _git(here, "rev-parse", "--show-toplevel")
    if top is None or not top.strip():
        return None
    checkout = Path(top.strip())
    if _git(checkout, "ls-files", "--error-unmatch", str(here / "__init__.py")) is None:
        return None
    return checkout


def _git(checkout: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def run_provenance() -> dict[str, Any]:
    """``commit`` (the checkout's HEAD, or None), ``dirty`` (tracked files differing from it, or files
    under ``lgc/`` git does not track; None without a checkout), ``changed`` (those files, at most
    :data:`MAX_CHANGED_PATHS`), ``changed_count``
    and the versions of ``lgc``, ``torch``, ``pytorch_lightning``, ``torchvision`` and ``python``."""
    import platform

    import torch

    record: dict[str, Any] = {"commit": None, "dirty": None, "changed": [], "changed_count": 0}
    checkout = package_checkout()
    if checkout is not None:
        head = _git(checkout, "rev-parse", "HEAD")
        status = _git(checkout, "status", "--porcelain", "--untracked-files=no")
        # Files git does not track yet inside the package change the code that runs too.
        untracked = _git(checkout, "ls-files", "--others", "--exclude-standard", "--", "lgc")
        if head is not None:
            record["commit"] = head.strip()
        if status is not None and untracked is not None:
            changed = [line[3:] for line in status.splitlines() if line.strip()]
            changed += [f"{path} (untracked)" for path in untracked.splitlines() if path.strip()]
            record |= {"dirty": bool(changed), "changed": changed[:MAX_CHANGED_PATHS], "changed_count": len(changed)}
    record["versions"] = {
        "lgc": _version("lgc"),
        "torch": torch.__version__,
        "pytorch_lightning": _version("pytorch-lightning"),
        "torchvision": _version("torchvision"),
        "python": platform.python_version(),
    }
    return record
