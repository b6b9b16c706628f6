"""``lgc-bench``: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse

from lgc.bench import autoencoder, compressors

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lgc-bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    benchmarks = {"compressors": compressors, "autoencoder": autoencoder}
    for name, module in benchmarks.items():
        module.add_arguments(commands.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    benchmarks[args.command].run(args)


if __name__ == "__main__":
    main()
