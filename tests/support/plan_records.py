"""Plan records (``datagen.specs.plan.ExtractionPlan``) made by hand, for the tests that pass
a plan along without a model to plan it from."""

from __future__ import annotations

from datagen.data.contract import ResolvedSpec
from datagen.specs.extraction import ExtractSpec
from datagen.specs.plan import ExtractionPlan


def plan_record(*, spec: ExtractSpec | None = None, **overrides) -> ExtractionPlan:
    """A plan of 2 shards (rows [0, 2) and [2, 4)) of a 4-layer model of hidden size 8, layers (1, 3),
    made for the transformers engine; ``spec`` and any field given replace the builder's."""
    spec = spec or ExtractSpec(model="/models/m", dataset="/data/rows.jsonl", out="/out/ds", layer_ids=(1, 3),
                               engine={"name": "hf"}, max_seq_len=64)
    resolved = ResolvedSpec.model_validate({
        "model": {"source": spec.model, "revision": "content:" + "c" * 64, "architecture": "LlamaForCausalLM",
                  "num_hidden_layers": 4, "hidden_size": 8},
        "layer_ids": [1, 3], "layer_numbering": "vllm", "dtype": "bfloat16", "storage_dtype": "bfloat16",
        "preprocessing": {"max_seq_len": 64, "chat_template_sha256": None, "tokenizer_sha256": None,
                          "samples_per_shard": 2},
        "engine": {"name": "hf", "version": "0", "patches": [], "shard_group": 1},
        "dataset": {"source": spec.dataset, "sha256": "d" * 64, "rows": 4, "format": "jsonl/tokens"},
    })
    fields = dict(spec=spec, resolved=resolved, engine={"name": "hf", "version": "0", "patches": []},
                  fingerprint="f" * 64, extraction_fingerprint="e" * 64, boundaries=(0, 2, 4), tokens=(10, 20),
                  shard_keys=("a" * 64, "b" * 64), shard_group=1, stored_plan=None)
    return ExtractionPlan(**{**fields, **overrides})
