"""``lgc-bench``: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse

from lgc.bench import compressors

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lgc-bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    compressors.add_arguments(commands.add_parser("compressors", help=compressors.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    if args.command == "compressors":
        compressors.run(args)


if __name__ == "__main__":
    main()
