"""Print the fault campaign's table (Markdown) from the records the tests wrote.

    python -m tests.faults.report                 # the full campaign's records (out/faults/full)
    python -m tests.faults.report --short         # the short campaign's (make test)
    python -m tests.faults.report --detail        # also one row per bad-input case
    python -m tests.faults.report --json          # the records, merged, as JSON

One row per case; the explicit bad-input cases are summed up per step (``--detail`` lists them).
A case that failed, or an expected failure that is still open, says so in the Result column.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from tests.faults._results import CATEGORIES, results_dir

MAX_NAMES = 12  # case names listed in a summed-up row
TITLES = {
    "crash": "Crash anywhere (kill -9, resume)",
    "infrastructure": "Infrastructure faults",
    "bad-input": "Bad inputs",
    "hostile": "Hostile inputs",
    "secrets": "Secrets",
}


def load(d: Path) -> list[dict]:
    records = [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))]
    return sorted(records, key=lambda r: (CATEGORIES.index(r["category"]), r["case"].lower()))


def _result(r: dict) -> str:
    if r["passed"]:
        return "pass"
    if str(r.get("outcome", "")).startswith("SKIPPED"):
        return "skipped"
    return "OPEN" if str(r.get("outcome", "")).startswith("OPEN") else "FAIL"


def _command(r: dict) -> str:
    d = r.get("details", {})
    scale = f"DATAGEN_FAULTS_EXAMPLES_SCALE={d['examples_scale']} " if d.get("examples_scale") else ""
    return f"`{'DATAGEN_FAULTS_FULL=1 ' if d.get('campaign') == 'full' else ''}{scale}{r['command']}`"


def _outcome(r: dict) -> str:
    """The recorded outcome, with the crash campaign's phase counts when the record has them."""
    d = r.get("details", {})
    text = r["outcome"]
    if "phases" in d:
        phases = ", ".join(f"{n} {p}" for p, n in sorted(d["phases"].items(), key=lambda x: -x[1]))
        text += f"; kills by phase: {phases}"
    if d.get("unrecorded_shards_recovered"):
        text += (f"; {d['unrecorded_shards_recovered']} shards killed between rename and record were recovered "
                 "from their files")
    return text


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def rows(records: list[dict], *, detail: bool) -> dict[str, list[list[str]]]:
    """Category -> table rows (case, attempts, outcome, data lost, result, command)."""
    out: dict[str, list[list[str]]] = defaultdict(list)
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        group = r.get("details", {}).get("group")
        if r["category"] == "bad-input" and group and group != "generated" and not detail:
            groups[group].append(r)
            continue
        out[r["category"]].append([_cell(r["case"]), str(r["attempts"]), _cell(_outcome(r)), _cell(r["data_lost"]),
                                   _result(r), _command(r)])
    for group, rs in sorted(groups.items()):
        refused = sum(r["passed"] for r in rs)
        bad = [r for r in rs if not r["passed"] and _result(r) != "skipped"]
        skipped = [r for r in rs if _result(r) == "skipped"]
        shown = [r["case"].split(": ", 1)[-1] for r in rs][:MAX_NAMES]
        names = "; ".join(shown) + (f"; ... {len(rs) - len(shown)} more (--detail)" if len(rs) > len(shown) else "")
        outcome = (f"{refused}/{len(rs)} as specified (a refusal: its exit code, the problem named, a `->` hint, "
                   "nothing written)")
        if bad or skipped:
            outcome += "; " + "; ".join(f"{_result(r)}: {r['case']}: {r['outcome']}" for r in bad + skipped)
        files = sorted({r["command"].split("::")[0] for r in rs})
        prefix = "DATAGEN_FAULTS_FULL=1 " if rs[0].get("details", {}).get("campaign") == "full" else ""
        out["bad-input"].append([_cell(f"{group}: {len(rs)} cases ({names})"), str(len(rs)), _cell(outcome), "n/a",
                                 "pass" if not bad else ("OPEN" if all(_result(r) == "OPEN" for r in bad) else "FAIL"),
                                 f"`{prefix}{' '.join(files)}`"])
    return out


def render(records: list[dict], *, detail: bool = False) -> str:
    table = rows(records, detail=detail)
    lines = []
    for cat in CATEGORIES:
        if cat not in table:
            continue
        lines += [f"### {TITLES[cat]}", "", "| Case | Attempts | Outcome | Data lost | Result | Reproduce |",
                  "| --- | ---: | --- | --- | --- | --- |"]
        lines += ["| " + " | ".join(r) + " |" for r in table[cat]]
        lines.append("")
    total = len(records)
    passed = sum(r["passed"] for r in records)
    open_ = sum(_result(r) == "OPEN" for r in records)
    skipped = sum(_result(r) == "skipped" for r in records)
    lines.append(f"{total} cases: {passed} pass, {open_} open (expected failures, reported), "
                 f"{skipped} skipped (this machine cannot run them: the reason is in the row), "
                 f"{total - passed - open_ - skipped} fail.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=None, help="results directory (default: out/faults/full)")
    parser.add_argument("--short", action="store_true", help="the short campaign's records (out/faults/short)")
    parser.add_argument("--detail", action="store_true", help="one row per bad-input case")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args(argv)
    d = args.results or results_dir(full=not args.short)
    records = load(d)
    if not records:
        print(f"no records in {d}: run `make faults` first", file=sys.stderr)
        return 1
    print(json.dumps(records, indent=1) if args.json else render(records, detail=args.detail))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
