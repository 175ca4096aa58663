"""The report task: `datagen report` of a run's dataset after the deployment's runs before it, attached
to the run as the `layer-report` artifact, and this run's statistics recorded for the next. The step
task (``tasks/step.py``) under the name ``report``; the history of earlier runs is Prefect's (the
artifacts of ``tasks.artifacts.stats_key``), handed to the step as a file.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import deployment, flow_run

from tasks.artifacts import REPORT_RUNS, report_markdown, run_history, stats_key
from tasks.mounts import mounts_for
from tasks.pipeline_spec import Runner
from tasks.step import StepCall, step_task
from tasks.step_files import scratch_dir

report_step = step_task("report")  # not cached: it reads the runs before this one


@task(name="layer-report")
def layer_report(dataset: str, *, previous: str | None = None, runs: int = REPORT_RUNS,
                 runner: Runner = Runner.LOCAL) -> list[int]:
    """Attach the plot of this run's per-layer statistics next to the deployment's previous runs (the
    `datagen report` step, given the runs before as its history) and record this run's statistics
    for the next. Drift is measured against ``previous`` when validation has one (the dataset it
    compares with), else the run before. Returns the drifted layers. A report that cannot be drawn
    is logged, never fails the run."""
    from datagen.steps.report import Spec  # matplotlib: imported where a run reports

    logger = get_run_logger()
    key = stats_key(flow_run.flow_name, deployment.name)
    try:
        history = run_history(key, runs - 1, exclude_flow_run=flow_run.id)
        with scratch_dir() as scratch:
            (scratch / "history.json").write_text(json.dumps([r.to_rows() for r in history]))
            spec = Spec(dataset=dataset, previous=[previous] if previous else [], out=str(scratch / "report.png"),
                        history=str(scratch / "history.json"),
                        title=f"{flow_run.flow_name}/{deployment.name or '-'}")
            call = StepCall(step="report", spec=spec.model_dump(mode="json"),
                            mounts=mounts_for(scratch, read_only=tuple(p for p in (dataset, previous) if p and "://" not in p)))
            drawn = report_step(call, runner=runner)
            png = Path(drawn.plot).read_bytes()
    except Exception as e:  # noqa: BLE001  (a report must not fail the night's data)
        logger.warning("layer report not drawn: %s: %s", type(e).__name__, e)
        return []
    drifted = list(drawn.drifted_layers)
    create_markdown_artifact(report_markdown(png, drawn.table, drifted=drifted), key="layer-report",
                             description="Per-layer mean, std, absmax and tokens of this and the previous runs; "
                                         "drift marked in red.")
    create_table_artifact(drawn.rows, key=key,
                          description="This run's per-layer statistics (the next runs' report reads them).")
    if drifted:
        logger.warning("layer statistics drifted beyond %.0f%% in layers %s (validation fails on it)",
                       100 * drawn.threshold, drifted)
    else:
        logger.info("layer report of %d runs attached; no drift", drawn.runs)
    return drifted
