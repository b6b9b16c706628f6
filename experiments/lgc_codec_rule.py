"""Which codec LGC-RAR runs in a study, decided by the study protocol's ``codec_rule`` from committed rows.

    python experiments/lgc_codec_rule.py [PROTOCOL]     # default: lgc_loop_protocol.yaml

The rule reads ``lgc-bench codecs`` results (``codec_rule.results``, a ``codecs.json`` under this
folder): on the recording whose label starts with ``codec_rule.recording``, at the run's density, with
the rule's leader, among the ``candidates`` (an ``lgc-bench codecs`` codec name -> the ``lgc-train``
overrides that run the same codec in LGC-RAR), the one with the lowest delivered-sum error at the
leader's positions; candidates within ``tie`` (relative) of the lowest are told apart by fewer total
wire bits per value. The rule applies only once that measurement is complete and every candidate has
a row: until then it raises, so a sweep refuses the runs that need it before any run starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def codec_choice(rule: dict[str, Any], density: float) -> tuple[str, list[str]]:
    """The chosen candidate's name and its overrides at ``density``; ValueError while it cannot be decided."""
    path = HERE / rule["results"]
    if not path.is_file():
        raise ValueError(f"the codec rule reads {path}, which does not exist yet (lgc-bench codecs)")
    wanted = f", density {density:g}"
    measured = json.loads(path.read_text())
    results = [r for r in measured if r["label"].startswith(rule["recording"]) and r["label"].endswith(wanted)]
    if len(results) != 1 or not results[0].get("complete", True):
        state = "not measured" if not results else "ambiguous" if len(results) > 1 else "still being measured"
        recording = rule["recording"]
        raise ValueError(f"the codec rule's recording {recording!r} at density {density:g} is {state} in {path}")
    rows = {row["codec"]: row for row in results[0]["rows"] if row["leader"] == rule["leader"]}
    missing = [name for name in rule["candidates"] if name not in rows or rows[name]["error"] is None]
    if missing:
        raise ValueError(f"the codec rule has no {rule['leader']}-leader row for {missing} at density {density:g}")
    best = min(rows[name]["error"] for name in rule["candidates"])
    close = [name for name in rule["candidates"] if rows[name]["error"] <= best * (1 + float(rule["tie"]))]
    chosen = min(close, key=lambda name: (rows[name]["bits_per_value"], rows[name]["error"]))
    return chosen, list(rule["candidates"][chosen])


def main(argv: list[str]) -> int:
    from scale_comparison import load_protocol

    protocol = load_protocol(Path(argv[0]) if argv else HERE / "lgc_loop_protocol.yaml")
    densities = sorted({float(m["codec_at"]) for m in protocol["methods"].values() if "codec_at" in m})
    for density in densities:
        try:
            name, overrides = codec_choice(protocol["codec_rule"], density)
        except ValueError as error:
            print(f"density {density:g}: undecided: {error}")
            continue
        print(f"density {density:g}: {name} ({' '.join(overrides)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
