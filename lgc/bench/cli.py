"""``lgc-bench``: benchmarks that print ratios measured side by side in one run.

The benchmark modules keep their heavy imports (Lightning, the recorder) inside the functions that
run a benchmark, so ``lgc-bench --help`` answers without loading them.
"""

from __future__ import annotations

import argparse
import re
from types import ModuleType

from lgc.bench import autoencoder, codecs, compressors, model, network, step

__all__ = ["main"]

_DESCRIPTION = "lgc-bench: benchmarks that print ratios measured side by side in one run."


def _plain(text: str) -> str:
    """Docstring reST as terminal text: ``code`` -> code, :func:`name` -> name."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


def _summary(module: ModuleType, name: str) -> str:
    """The docstring's first line without its ``lgc-bench name``: prefix."""
    first = _plain(module.__doc__.strip().splitlines()[0])
    return first.removeprefix(f"lgc-bench {name}:").strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lgc-bench", description=_DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    benchmarks = {
        "compressors": compressors,
        "autoencoder": autoencoder,
        "codecs": codecs,
        "network": network,
        "model": model,
        "step": step,
    }
    for name, module in benchmarks.items():
        module.add_arguments(
            commands.add_parser(
                name,
                help=_summary(module, name),
                description=_plain(module.__doc__.strip()),
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    args = parser.parse_args(argv)
    benchmarks[args.command].run(args)


if __name__ == "__main__":
    main()
