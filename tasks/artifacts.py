"""The run's artifacts: a progress bar updated during extraction, and at the end a markdown summary
(spec, fingerprint, what was cached, tokens, tokens/s, bytes, where the dataset is) and a table of
its shards.

Progress is counted in shards: each range contributes its share of the dataset's shards, and a
range that is running contributes the fraction its step reports (`datagen extract` logs
``progress X/Y tokens``). Ranges run in threads of the flow's process, so the board is shared
through this module and guarded by a lock.
"""

from __future__ import annotations

import re
import threading
import time
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact,
)

PROGRESS_LINE = re.compile(r"\bprogress (\d+)/(\d+) tokens\b")
MIN_UPDATE_INTERVAL_S = 2.0  # at most one progress update per range this often (API calls)


class ProgressBoard:
    """Completed fraction of each range of one run, published as one progress artifact."""

    def __init__(self, artifact_id: UUID | None, weights: dict[str, int]) -> None:
        self.artifact_id = artifact_id
        self.weights = weights  # range -> its number of shards
        self.done: dict[str, float] = {r: 0.0 for r in weights}
        self._lock = threading.Lock()
        self._last_update = 0.0

    def percent(self) -> float:
        total = sum(self.weights.values()) or 1
        return round(100.0 * sum(self.weights[r] * f for r, f in self.done.items()) / total, 1)

    def set(self, shard_range: str, fraction: float, *, force: bool = False) -> None:
        with self._lock:
            if shard_range not in self.done or fraction <= self.done[shard_range]:
                return
            self.done[shard_range] = min(fraction, 1.0)
            now = time.monotonic()
            if not force and now - self._last_update < MIN_UPDATE_INTERVAL_S:
                return
            self._last_update = now
            percent = self.percent()
        if self.artifact_id is not None:
            update_progress_artifact(self.artifact_id, percent)

    def line_watcher(self, shard_range: str):
        """A function to call with each output line of a range's step: it follows its progress."""

        def watch(line: str) -> None:
            m = PROGRESS_LINE.search(line)
            if m and int(m[2]) > 0:
                # Stop short of 1.0: the range is done when its task returns, not when its last token is.
                self.set(shard_range, 0.99 * int(m[1]) / int(m[2]))

        return watch


_boards: dict[UUID, ProgressBoard] = {}
_boards_lock = threading.Lock()


def start_progress(weights: dict[str, int], done: set[str], *, description: str) -> UUID | None:
    """Create the run's progress artifact; ranges in ``done`` count as complete. Returns its id."""
    board = ProgressBoard(None, weights)
    for r in done:
        board.done[r] = 1.0
    artifact_id = create_progress_artifact(
        progress=board.percent(), key="extract-progress", description=description
    )
    board.artifact_id = artifact_id
    if artifact_id is not None:
        with _boards_lock:
            _boards[artifact_id] = board
    return artifact_id


def board(artifact_id: UUID | None) -> ProgressBoard | None:
    """The board of ``artifact_id`` in this process, or None (another process, or no artifact)."""
    if artifact_id is None:
        return None
    with _boards_lock:
        return _boards.get(artifact_id)


def summary_markdown(
    *, spec: dict, dataset: dict, ranges: list[dict], published_to: str | None, validation: str
) -> str:
    """The run summary: what was extracted from what, what was cached, and where it is."""
    totals = dataset.get("totals", {})
    extracted = sorted(k for r in ranges for k in r.get("shards_extracted", []))
    cached = sorted(k for r in ranges for k in r.get("shards_cached", []))
    cached_ranges = [r["range"] for r in ranges if r.get("task_cached")]
    tokens_new = sum(r.get("tokens_extracted", 0) for r in ranges)
    seconds = sum(r.get("seconds", 0.0) for r in ranges if r.get("shards_extracted"))
    rate = f"{tokens_new / seconds:,.0f}" if seconds > 0 and tokens_new else "-"
    engine = dataset.get("engine") or {}
    lines = [
        "# Extraction summary",
        "",
        "| | |",
        "|---|---|",
        f"| dataset | `{dataset.get('dataset')}` |",
        f"| published to | `{published_to}` |" if published_to else "| published to | (not published) |",
        f"| fingerprint | `{dataset.get('fingerprint')}` |",
        f"| model | `{spec.get('model')}` |",
        f"| layer ids | {dataset.get('layer_ids') or spec.get('layer_ids')} |",
        f"| engine | {engine.get('name', spec.get('engine', {}).get('name'))} "
        f"{engine.get('version', '')} (TP {spec.get('engine', {}).get('tensor_parallel_size')}) |",
        f"| shards | {totals.get('shards')} ({len(extracted)} extracted now, {len(cached)} already there) |",
        f"| ranges served from the cache | {len(cached_ranges)} of {len(ranges)} |",
        f"| tokens | {totals.get('tokens', 0):,} ({tokens_new:,} extracted now) |",
        f"| tokens/s (extraction) | {rate} |",
        f"| bytes | {totals.get('bytes', 0):,} |",
        f"| validation | {validation} |",
        "",
        "## Spec",
        "",
        "```json",
        _json(spec),
        "```",
    ]
    return "\n".join(lines)


def _json(obj) -> str:
    import json

    return json.dumps(obj, indent=2, sort_keys=True, default=str)


@task(name="run-summary")  # not "report": that is the `datagen report` step's task (tasks/report.py)
def run_summary(
    *, spec: dict, dataset: dict, ranges: list[dict], published_to: str | None, validation: str
) -> None:
    """Publish the run's summary and shard table as artifacts."""
    create_markdown_artifact(
        summary_markdown(spec=spec, dataset=dataset, ranges=ranges, published_to=published_to,
                         validation=validation),
        key="extract-summary",
        description="What this run extracted, from what, and where the dataset is.",
    )
    extracted_now = {k for r in ranges for k in r.get("shards_extracted", [])}
    rows = [
        {
            "shard": s["index"],
            "path": s["path"],
            "first row": s["first_sample"],
            "rows": s["rows"],
            "samples": s["samples"],
            "tokens": s["tokens"],
            "bytes": s["bytes"],
            "sha256": s["sha256"][:16],
            "this run": "extracted" if s["index"] in extracted_now else "cached",
        }
        for s in dataset.get("shards", [])
    ]
    create_table_artifact(rows, key="extract-shards", description="Every shard of the dataset.")


# --- the nightly report: per-layer statistics of the last runs, drift marked --------------------

REPORT_RUNS = 8  # runs on the plot: this one and up to 7 before it
STATS_KEY_PREFIX = "layer-stats"


def stats_key(flow_name: str | None, deployment_name: str | None) -> str:
    """Artifact key of a deployment's per-run statistics: each run adds a version, the report reads the last
    ones (keys hold lowercase letters, digits and dashes)."""
    raw = f"{STATS_KEY_PREFIX}-{flow_name or 'flow'}-{deployment_name or 'no-deployment'}".lower()
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw)).strip("-")


def table_history(key: str, limit: int, *, exclude_flow_run) -> list[list[dict]]:
    """The rows of the last ``limit`` table artifacts recorded under ``key`` (one list per run), oldest first."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                      sort=ArtifactSort.CREATED_DESC, limit=limit + 1)
    runs = []
    for a in found:
        if exclude_flow_run is not None and a.flow_run_id == exclude_flow_run:
            continue  # a retry of this run: not a run before it
        rows = json.loads(a.data) if isinstance(a.data, str) else a.data
        if rows:
            runs.append(rows)
    return list(reversed(runs[:limit]))


def run_history(key: str, limit: int, *, exclude_flow_run) -> list:
    """The last ``limit`` runs' statistics recorded under ``key``, oldest first."""
    from datagen.validation.layer_report import RunStats

    return [RunStats.from_rows(rows) for rows in table_history(key, limit, exclude_flow_run=exclude_flow_run)]


def report_markdown(png: bytes, table: str, *, drifted: list[int]) -> str:
    import base64

    head = (f"# Layer statistics: DRIFT in layers {drifted}" if drifted else "# Layer statistics: no drift")
    return "\n".join([head, "", f"![per-layer statistics of the last runs](data:image/png;base64,"
                      f"{base64.b64encode(png).decode()})", "", table])


