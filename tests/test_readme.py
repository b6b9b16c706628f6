"""The README's commands and its plain-DDP example stay true."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_the_two_commands_ci_runs():
    first, second = _code_blocks("bash")[:2]
    assert "lgc-train" in first and "pip install" in first
    assert "pytest" in second and '".[dev]"' in second
    ci = (README.parent / ".ci" / "run").read_text()
    assert second.strip() in ci


@pytest.mark.multiprocess
def test_plain_ddp_example_runs_under_torchrun(tmp_path):
    (example,) = [block for block in _code_blocks("python") if "register_compression_hook" in block]
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ratios = [float(x) for x in re.findall(r"rank \d: ([\d.]+)x fewer bytes than dense", result.stdout)]
    assert len(ratios) == 2 and all(ratio > 10 for ratio in ratios), result.stdout
