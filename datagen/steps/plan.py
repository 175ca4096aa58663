"""The plan step: ``datagen plan``. Checks a spec and prints what extraction would do.

Everything ``datagen extract`` checks before loading a weight is checked here
(spec, model config, every dataset row), and the result names the fingerprints
and every shard's cache key, so the orchestrator can key its cache on them
without importing the engine.
"""

from __future__ import annotations

from datagen.steps.extract import add_arguments as _extract_arguments
from datagen.steps.extract import completed_shards, plan, spec_from_args

HELP = "Check a spec and print its fingerprints and each shard's cache key (loads no weights)."


def add_arguments(parser) -> None:
    _extract_arguments(parser)


def main(args) -> dict:
    spec = spec_from_args(args)
    p = plan(spec)
    done = completed_shards(p) if _claimed_by(p) else {}
    _check_output_space(p, done)
    return {
        "fingerprint": p.fingerprint,
        "extraction_fingerprint": p.extraction_fingerprint,
        "num_shards": p.num_shards,
        "rows": p.data.rows,
        "tokens": p.data.tokens,
        "layer_ids": list(p.layer_ids),
        "hidden_size": p.info.hidden_size,
        "num_hidden_layers": p.info.num_hidden_layers,
        "shard_keys": [p.shard_key(k) for k in range(p.num_shards)],
        "shards_complete": sorted(done),
        "spec": p.resolved_spec,
    }


def _claimed_by(p) -> bool:
    import json
    from pathlib import Path

    from datagen.data.contract import STATE_DIR

    run_file = Path(p.spec.out) / STATE_DIR / "run.json"
    try:
        return json.loads(run_file.read_text()).get("extraction_fingerprint") == p.extraction_fingerprint
    except (OSError, ValueError):
        return False


def _check_output_space(p, done: dict) -> None:
    """Refuse before any engine starts when the output cannot hold what is left to extract.

    The env check can only estimate the output from a spec's ``expected_tokens`` (it runs before
    the model and its tokenizer are here); the plan has the exact count.
    """
    from datagen.errors import CannotRunHereError
    from datagen.steps.env_check import Status, check_output_space

    left = p.data.tokens - sum(rec.tokens for rec in done.values())
    dtype = getattr(p.spec, "storage_dtype", None) or p.spec.engine.dtype  # fp8 storage, where the spec has it
    check = check_output_space(p.spec.out, tokens=max(left, 0), n_layers=len(p.layer_ids),
                               hidden_size=p.info.hidden_size, dtype=str(getattr(dtype, "value", dtype)))
    if check.status is Status.FAILED:
        raise CannotRunHereError(f"the output location cannot hold this dataset: {check.detail}", hint=check.fix)
