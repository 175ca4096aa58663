"""The export task (`datagen export --format speculators`, for training outside the pipeline) returns the
export step's own result, and keeps an export that is there already."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from prefect import flow

from datagen.data.contract import MANIFEST_NAME
from datagen.export.speculators import EXPORT_RECORD
from datagen.steps.export import ExportResult
from tasks.pipeline_spec import Runner
from tasks.export import export_speculators
from tests.support.extracted import copy_dataset, extracted_dataset


@flow(name="export-again")
def export_again(dataset: str, out: str) -> ExportResult | None:
    return export_speculators(dataset, out, cache_key=f"not-cached-{out}", runner=Runner.LOCAL)


@pytest.mark.prefect_server
def test_an_export_there_already_is_kept(prefect_harness, tmp_path_factory, tmp_path):
    ds = copy_dataset(extracted_dataset(tmp_path_factory), tmp_path / "dataset")
    raw = (ds / MANIFEST_NAME).read_bytes()
    fingerprint = json.loads(raw)["fingerprint"]
    out = f"{ds}.speculators-{fingerprint[:12]}"

    assert export_again(str(ds), out) is not None
    record = json.loads((Path(out) / EXPORT_RECORD).read_text())
    assert (record["fingerprint"], record["manifest_sha256"]) == (fingerprint, hashlib.sha256(raw).hexdigest())
    written = (Path(out) / EXPORT_RECORD).stat().st_mtime_ns

    # Not found in the cache (another key), the export there already is kept: the step does not run.
    assert export_again(str(ds), out) is None
    assert (Path(out) / EXPORT_RECORD).stat().st_mtime_ns == written


@pytest.mark.prefect_server
def test_the_export_task_returns_the_export_steps_result(prefect_harness, tmp_path_factory, tmp_path):
    ds = copy_dataset(extracted_dataset(tmp_path_factory), tmp_path / "dataset")
    raw = (ds / MANIFEST_NAME).read_bytes()
    out = str(tmp_path / "speculators")

    result = export_again(str(ds), out)
    assert isinstance(result, ExportResult)
    assert (result.out, result.cached, result.format) == (out, False, "speculators")
    assert result.manifest_sha256 == hashlib.sha256(raw).hexdigest()
    assert result.fingerprint == json.loads(raw)["fingerprint"]
    assert (Path(out) / EXPORT_RECORD).is_file()
