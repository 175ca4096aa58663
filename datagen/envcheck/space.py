"""Free space: at the model cache for the download, and at a local output for the states."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from datagen.data.contract import token_bytes
from datagen.envcheck.model import ModelFacts
from datagen.envcheck.report import Check, Status, size_text
from datagen.storage.model_cache import ModelCache
from datagen.specs.source import LocalSource, SourcesSpec, is_s3_uri

SPACE_MARGIN = 1.05  # ask for 5% more than the estimate


def _free(path: Path) -> tuple[Path, int, int]:
    """(nearest existing ancestor, its free bytes, its device id)."""
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return p, shutil.disk_usage(p).free, os.stat(p).st_dev


def check_storage(spec: SourcesSpec, cache: ModelCache, facts: ModelFacts | None, output_bytes: int | None) -> list[Check]:
    need_cache = 0 if facts is None or facts.cached else facts.total_bytes
    local_out = None if is_s3_uri(spec.out) else Path(spec.out)
    cache_at, cache_free, cache_dev = _free(cache.root)
    checks = []
    if need_cache is None:
        checks.append(Check(name="storage.model_cache", status=Status.UNKNOWN, detail="model size unknown (Hub offline and not cached)", fix="retry with Hub access"))
    elif not isinstance(spec.source, LocalSource):
        checks.append(_space_check("storage.model_cache", cache_at, cache_free, need_cache, "the model download", "DATAGEN_MODEL_CACHE"))
    else:
        checks.append(Check(name="storage.model_cache", status=Status.SKIPPED, detail="local model: used in place"))
    if local_out is None:
        checks.append(Check(name="storage.output", status=Status.SKIPPED, detail="output is in S3 (see remote.output)"))
    elif output_bytes is None:
        checks.append(Check(name="storage.output", status=Status.SKIPPED,
                            detail="the spec gives no expected_tokens: plan checks the output against its token count"))
    else:
        out_at, out_free, out_dev = _free(local_out)
        shared = out_dev == cache_dev and need_cache
        need = output_bytes + (need_cache if shared else 0)
        what = "the output" + (" and the model download (same disk)" if shared else "")
        checks.append(_space_check("storage.output", out_at, out_free, need, what, "the spec's out"))
    return checks


def output_bytes_per_token(n_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes one stored token costs: its states in ``storage_dtype`` (with fp8's scales), its id and mask."""
    return token_bytes(storage_dtype, n_layers=n_layers, hidden_size=hidden_size)


def check_output_space(out: str | Path, *, tokens: int, n_layers: int, hidden_size: int, dtype: str) -> Check:
    """Whether the output location holds ``tokens`` more tokens (the plan's count of what is
    still to extract): the estimate the env check makes from ``expected_tokens``, made exact."""
    if is_s3_uri(str(out)):
        return Check(name="storage.output", status=Status.SKIPPED, detail="output is in S3")
    at, free, _ = _free(Path(out))
    per_token = output_bytes_per_token(n_layers, hidden_size, dtype)
    return _space_check("storage.output", at, free, tokens * per_token,
                        f"the output ({tokens} tokens x {per_token} bytes)", "the spec's out")


def _space_check(name: str, at: Path, free: int, need: int, what: str, knob: str) -> Check:
    if free < need * SPACE_MARGIN:
        return Check(
            name=name,
            status=Status.FAILED,
            detail=f"{at} has {size_text(free)} free; {what} needs {size_text(need)} (+{SPACE_MARGIN - 1:.0%})",
            fix=f"free space at {at}, or point {knob} at a disk with {size_text(need * SPACE_MARGIN)} free",
        )
    return Check(name=name, status=Status.OK, detail=f"{at}: {size_text(free)} free, {what} needs {size_text(need)}")
