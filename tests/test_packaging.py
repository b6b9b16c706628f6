"""The core install (``pip install lgc``) is torch, numpy, omegaconf and pydantic; the rest is the ``train`` extra."""

import subprocess
import sys
from pathlib import Path

from lgc.commands import TRAINING_STACK

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import sys
import lgc
from lgc.methods import METHODS, build_hook_state
for name in METHODS:
    node = METHODS[name].resolve()
    if not name.startswith(("lgc_", "shared_", "leader_", "torch_", "powersgd", "batched_")):
        build_hook_state(node)
print(" ".join(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_lgc_and_every_compressor_by_name_import_nothing_of_the_training_stack():
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=ROOT, check=True)
    loaded = set(result.stdout.split())
    assert "torch" in loaded and "omegaconf" in loaded
    heavy = {*TRAINING_STACK, "matplotlib", "scipy", "lightning", "lightning_fabric"}
    assert not loaded & heavy, f"the core imports {sorted(loaded & heavy)}"
