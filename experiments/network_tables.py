"""The evidence page's blocks from committed shaped-network records (``lgc-bench network``).

    python experiments/network_tables.py [--write]

Each block of :data:`BLOCKS` reads one record: time to accuracy over 100 Mbit/s and 1 Gbit/s links
(``experiments/results/fashion_mnist_network/network.json.gz``, written by
``experiments/fashion_mnist_network.sh``) and Streaming DiLoCo's overlap
(``experiments/results/streaming_overlap_network/network.json.gz``, written by
``experiments/streaming_overlap_network.sh``). For every setting of a record it gives each method's time
to the target over seeds as a multiple of the no-communication bound
(:func:`lgc.bench.network_results.seeds_table`), the link as fitted on plain collectives, and the
commits the measurements ran, where their records name them. It prints the blocks; with ``--write``
it replaces each in ``docs/evidence.md`` between its markers.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from one_message_tables import replace_in

from lgc.bench.network import read_record
from lgc.bench.network_results import over_seeds, seeds_table

HERE = Path(__file__).resolve().parent
EVIDENCE = HERE.parent / "docs" / "evidence.md"
RESULTS = HERE / "results"
# Block name (its markers are ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``) -> its record.
BLOCKS = {
    "time-to-accuracy": RESULTS / "fashion_mnist_network" / "network.json.gz",
    "streaming-overlap": RESULTS / "streaming_overlap_network" / "network.json.gz",
}


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name`` on the evidence page."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def commits(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Which commits a setting's measurements ran, and how many of them predate the record's ``provenance``."""
    seen = Counter(
        (run.get("provenance") or {}).get("commit") or "not recorded" for series in runs.values() for run in series
    )
    named = {commit if commit == "not recorded" else commit[:7]: n for commit, n in sorted(seen.items())}
    return ", ".join(f"{commit} ({n})" for commit, n in named.items())


def link(record: dict[str, Any], setting: str) -> str:
    """The link as ``lgc-bench network`` fitted it on plain allreduces and allgathers in ``setting``."""
    fitted = (record.get("calibrations") or {}).get(setting) or {}
    if "latency_s" not in fitted:
        return "The record holds no fitted link."
    return (
        f"The link as fitted on plain allreduces and allgathers: {1e6 * fitted['latency_s']:.0f} us per message, "
        f"{8 * fitted['bytes_per_s'] / 1e6:.1f} Mbit/s."
    )


def block(record: dict[str, Any]) -> str:
    arguments = record["arguments"]
    target, skip = float(arguments["target"]), int(arguments["skip"])
    parts = []
    for setting, runs in record["raw"].items():
        result = (record.get("over_seeds") or {}).get(setting) or over_seeds(runs, target, skip)
        parts.append(
            f"{setting}, {arguments['steps']} steps, seeds {arguments['seeds']} (measurements by commit: "
            f"{commits(runs)}):\n\n{seeds_table(result)} {link(record, setting)}"
        )
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the blocks in docs/evidence.md")
    args = parser.parse_args()
    page = EVIDENCE.read_text()
    for name, record in BLOCKS.items():
        text = block(read_record(record))
        print(f"{name}:\n\n{text}\n")
        page = replace_in(page, text, *markers(name))
    if args.write:
        EVIDENCE.write_text(page)


if __name__ == "__main__":
    main()
