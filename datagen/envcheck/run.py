"""Every check in order (``check``), the report, and the error it makes (``raise_for_report``)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from datagen.specs.extraction import EngineName
from datagen.engines.accelerators import Accelerators, probe
from datagen.envcheck.engine import (
    _engine_path,
    check_architecture,
    check_capture,
    check_cpu_engine,
    check_engine_patches,
    check_engine_version,
    check_tensor_parallel,
)
from datagen.envcheck.model import ModelFacts, check_layers, read_model_facts, text_config
from datagen.envcheck.remote import check_hub_token, check_remote_output
from datagen.envcheck.report import Check, EnvReport, Status, size_text
from datagen.envcheck.space import check_storage, output_bytes_per_token
from datagen.errors import CannotRunHereError, DatagenError, TransientError
from datagen.storage.model_cache import ModelCache, cache_root
from datagen.specs.source import SourcesSpec

log = logging.getLogger(__name__)


def _describe(acc: Accelerators) -> str:
    if not acc.devices:
        return f"no GPU ({acc.note})" if acc.note else "no GPU"
    names = sorted({d.name for d in acc.devices})
    return (
        f"{acc.count} x {', '.join(names)} ({size_text(acc.devices[0].memory_bytes)} each) via {acc.source.value}; "
        f"driver {acc.driver_version or '?'}, CUDA {acc.cuda_version or '?'}"
    )


def _guarded(name: str, fn: Callable[[], Check]) -> Check:
    """Run a check; a DatagenError becomes its report line (transient ones 'unknown')."""
    try:
        return fn()
    except TransientError as e:
        return Check(name=name, status=Status.UNKNOWN, detail=e.message, fix=e.hint)
    except DatagenError as e:
        return Check(name=name, status=Status.FAILED, detail=e.message, fix=e.hint)
    except Exception as e:  # noqa: BLE001  (a network library's own error: could not tell)
        return Check(name=name, status=Status.UNKNOWN, detail=f"{type(e).__name__}: {e}", fix="retry")


def check(spec: SourcesSpec) -> EnvReport:
    start = time.monotonic()
    cache = ModelCache(cache_root(spec.model_cache))
    acc = probe()
    checks: list[Check] = [Check(name="accelerators", status=Status.OK, detail=_describe(acc))]

    facts: ModelFacts | None = None

    def model_source() -> Check:
        nonlocal facts
        facts = read_model_facts(spec, cache)
        return Check(name="model_source", status=Status.OK, detail=f"{spec.model}: config readable" + (", cached" if facts.cached else ""))

    checks.append(_guarded("model_source", model_source))
    layer_ids, hidden = None, None
    if facts is not None:
        layer_check, layer_ids, hidden = check_layers(spec, facts.config)
        checks.append(layer_check)
        checks.append(_guarded("architecture", lambda: check_architecture(spec, facts.config)))
        if layer_ids:
            checks.append(_guarded("capture", lambda: check_capture(spec, facts.config, layer_ids)))
    checks.append(check_tensor_parallel(spec, acc, facts.total_bytes if facts else None))
    checks.append(check_cpu_engine(spec, acc))
    version = _guarded("engine_version", lambda: check_engine_version(spec))
    checks.append(version)
    engine: dict = {}
    if spec.engine.name is EngineName.VLLM:
        try:
            arch = (facts.config.get("architectures") or [None])[0] if facts else None
            engine = _engine_path(spec.engine.tensor_parallel_size, arch)
        except Exception as e:  # noqa: BLE001 (the report is returned in every case)
            engine = {"error": f"{type(e).__name__}: {e}"}
    checks.append(_guarded("engine_patches", lambda: check_engine_patches(spec, version.status is Status.OK, engine)))
    output_bytes = None
    if spec.expected_tokens and layer_ids and hidden:
        per_token = output_bytes_per_token(len(layer_ids), hidden, spec.engine.resolved_storage_dtype)
        output_bytes = spec.expected_tokens * per_token
    checks.extend(check_storage(spec, cache, facts, output_bytes))
    checks.append(_guarded("remote.output", lambda: check_remote_output(spec)))
    checks.append(_guarded("remote.hub_token", lambda: check_hub_token(spec)))

    text = text_config(facts.config) if facts else {}
    if engine.get("capture_path"):
        log.info("%-18s %s on model runner %s (%s)", "capture_path", engine["capture_path"],
                 engine["model_runner"], engine["why"])
    report = EnvReport(
        engine=engine,
        ok=all(c.status in (Status.OK, Status.SKIPPED) for c in checks),
        checks=checks,
        accelerators=acc,
        model={
            "source": spec.model,
            "architecture": (facts.config.get("architectures") or [None])[0] if facts else None,
            "num_hidden_layers": text.get("num_hidden_layers"),
            "hidden_size": hidden,
            "layer_ids": list(layer_ids) if layer_ids else None,
            "bytes": facts.total_bytes if facts else None,
            "cached": facts.cached if facts else None,
        },
        estimate={
            "model_cache_bytes": 0 if facts and facts.cached else (facts.total_bytes if facts else None),
            "output_bytes": output_bytes,
            "output_bytes_per_token": (output_bytes // spec.expected_tokens) if output_bytes else None,
        },
        seconds=round(time.monotonic() - start, 3),
    )
    for c in checks:
        level = logging.INFO if c.status in (Status.OK, Status.SKIPPED) else logging.WARNING
        log.log(level, "%-18s %-7s %s%s", c.name, c.status.value, c.detail, f" -> {c.fix}" if c.fix else "")
    return report


def raise_for_report(report: EnvReport) -> None:
    """CannotRunHereError if a check failed; TransientError if one could not tell."""
    failed = [c for c in report.checks if c.status is Status.FAILED]
    unknown = [c for c in report.checks if c.status is Status.UNKNOWN]
    if failed:
        raise CannotRunHereError(
            "this spec cannot run here:\n" + "\n".join(f"  {c.name}: {c.detail}" for c in failed),
            hint="; ".join(f"{c.name}: {c.fix}" for c in failed if c.fix),
        )
    if unknown:
        raise TransientError(
            "env-check could not tell:\n" + "\n".join(f"  {c.name}: {c.detail}" for c in unknown),
            hint="retry; " + "; ".join(f"{c.name}: {c.fix}" for c in unknown if c.fix),
        )
