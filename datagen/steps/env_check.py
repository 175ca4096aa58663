"""The `env-check` step: will this spec run here? Answered in seconds, before any GPU hour.

``datagen env-check --spec SPEC [--report PATH]`` checks the accelerators, the engine (vLLM's
version, patches and capture path), the model (config, layer ids, architecture), free space and
the remotes, and reports as JSON. The checks are the library ``datagen.envcheck``; this module
wires a spec file to them.

Each check is ``ok``, ``failed`` (with what to fix), ``unknown`` (could not tell: a network or
storage fault) or ``skipped`` (does not apply). Exit codes: any failed check ->
``EXIT_CANNOT_RUN_HERE`` (permanent); else any unknown -> ``EXIT_TRANSIENT`` (retry); else 0.
The report is returned (and written to ``--report``) in every case.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from datagen.envcheck.report import EnvReport
from datagen.steps._args import StepSpec

HELP = "Check that the spec can run here (GPUs, engine, model, storage, credentials); JSON report."


class Spec(StepSpec):
    """``datagen env-check``'s command line."""

    spec: str = Field(description="spec JSON (datagen.specs.source.SourcesSpec)")
    report: str | None = Field(None, description="also write the JSON report here (written whatever the outcome)")


Result = EnvReport


def run(spec: Spec) -> EnvReport:
    """``datagen env-check``: every check (``datagen.envcheck.run.check``); the report also to
    ``--report``; an error when a check failed (``raise_for_report``)."""
    from datagen.envcheck.run import check, raise_for_report  # storage, Hub and engine code: imported where a run checks
    from datagen.specs.source import load_sources_spec

    report = check(load_sources_spec(spec.spec))
    if spec.report:
        Path(spec.report).parent.mkdir(parents=True, exist_ok=True)
        Path(spec.report).write_text(report.model_dump_json(indent=2))
    raise_for_report(report)
    return report
