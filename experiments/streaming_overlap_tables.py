"""The evidence page's block on Streaming DiLoCo's overlap, from the committed shaped-network record.

    python experiments/streaming_overlap_tables.py [--write]

Reads ``experiments/results/streaming_overlap_network/network.json.gz`` (written by
``experiments/streaming_overlap_network.sh``). For every setting it gives each method's time to the
target over seeds as a multiple of the no-communication bound
(:func:`lgc.bench.network_results.seeds_table`) and the commits the measurements ran, where their
records name them. It prints the block; with ``--write`` it replaces the block in
``docs/evidence.md`` between its markers.
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
RECORD = HERE / "results" / "streaming_overlap_network" / "network.json.gz"
BEGIN, END = "<!-- streaming-overlap:begin -->", "<!-- streaming-overlap:end -->"


def commits(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Which commits a setting's measurements ran, and how many of them predate the record's ``provenance``."""
    seen = Counter(
        (run.get("provenance") or {}).get("commit") or "not recorded" for series in runs.values() for run in series
    )
    named = {commit if commit == "not recorded" else commit[:7]: n for commit, n in sorted(seen.items())}
    return ", ".join(f"{commit} ({n})" for commit, n in named.items())


def block(record: dict[str, Any]) -> str:
    arguments = record["arguments"]
    target, skip = float(arguments["target"]), int(arguments["skip"])
    parts = []
    for setting, runs in record["raw"].items():
        result = (record.get("over_seeds") or {}).get(setting) or over_seeds(runs, target, skip)
        parts.append(
            f"{setting}, {arguments['steps']} steps, seeds {arguments['seeds']} (measurements by commit: "
            f"{commits(runs)}):\n\n{seeds_table(result)}"
        )
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the block in docs/evidence.md")
    args = parser.parse_args()
    text = block(read_record(RECORD))
    print(text)
    if args.write:
        EVIDENCE.write_text(replace_in(EVIDENCE.read_text(), text, BEGIN, END))


if __name__ == "__main__":
    main()
