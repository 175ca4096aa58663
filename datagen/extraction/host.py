"""A plan at work on this host: the plan file checked against what this host has (its copy of the
model, its engine, the dataset file), then the rows of the shards at hand.

Nothing here works the extraction out again: the layers, the dtypes, max_seq_len, the fingerprints,
the shard cut and the shard keys are the plan's (``datagen.specs.plan``). A host whose
model or engine is not the plan's is refused before any weight loads, saying which differs.
"""

from __future__ import annotations

import logging
from pathlib import Path

from datagen.data.dataset import PreparedDataset, file_fingerprint
from datagen.data.planning import prepare_dataset
from datagen.errors import CannotRunHereError, DatasetError, ModelError
from datagen.extraction import stored
from datagen.extraction.plan import Plan, describe_engine
from datagen.specs.plan import ExtractionPlan, ShardCut
from datagen.models.modelinfo import ModelInfo, inspect_model, model_content_hash

log = logging.getLogger(__name__)

REPLAN_HINT = "plan again (`datagen plan --plan-file FILE`; the extract flow plans on every run)"


def check_host(record: ExtractionPlan, info: ModelInfo) -> None:
    """This host's model and engine are the plan's. Loads no weight.

    Raises:
        ModelError: the model here has another architecture, shape or content than the plan's.
        CannotRunHereError: this host's engine (its version, patches, attention backend, capture
            path or model runner) is not the one the plan was made for.
    """
    model = record.resolved.model
    facts = {"architecture": (info.architecture, model.architecture),
             "num_hidden_layers": (info.num_hidden_layers, model.num_hidden_layers),
             "hidden_size": (info.hidden_size, model.hidden_size)}
    differ = [f"{name} {here} (the plan's: {want})" for name, (here, want) in facts.items() if here != want]
    if not differ and record.spec.model_revision is None:  # the plan's identity is the files' content
        here = f"content:{model_content_hash(info)}"
        if here != model.revision:
            differ = [f"content {here[8:20]} (the plan's: {str(model.revision)[8:20]})"]
    if differ:
        raise ModelError(f"the model at {info.path} is not the one the plan was made for: {'; '.join(differ)}",
                         hint="give this host the plan's model (the same revision), or " + REPLAN_HINT)
    engine = describe_engine(record.spec, info)
    differ = [f"{k} {engine.get(k)!r} here, {record.engine.get(k)!r} in the plan"
              for k in sorted(set(engine) | set(record.engine)) if engine.get(k) != record.engine.get(k)]
    if differ:
        raise CannotRunHereError(
            "this host's engine is not the one the plan was made for: " + "; ".join(differ),
            hint="run it where the plan was made (the same image or environment), or " + REPLAN_HINT)


def plan_on_host(record: ExtractionPlan, *, shards: tuple[int, int]) -> tuple[Plan, bool]:
    """The plan at work here with the samples of ``shards``, and whether they came from a stored plan
    (else the dataset was tokenized again, and checked to give the plan's tokens).

    Raises:
        ModelError, CannotRunHereError: this host's model or engine is not the plan's (``check_host``).
        DatasetError: the dataset file is not the one planned.
    """
    spec = record.spec
    info = inspect_model(spec.model, trust_remote_code=spec.engine.trust_remote_code)
    check_host(record, info)
    data, how = _stored(record, shards)
    if data is not None:
        log.info("plan: the rows of shards %d:%d %s", *shards, how)
        return Plan(record, info, data), True
    log.info("plan: %s; tokenizing the dataset again", how)
    return Plan(record, info, _tokenized(record, info)), False


def _check_dataset(record: ExtractionPlan, sha256: str) -> None:
    want = record.resolved.dataset.sha256
    if sha256 != want:
        raise DatasetError(f"the dataset is not the one planned (sha256 {sha256[:12]}, the plan's {str(want)[:12]})",
                           path=record.spec.dataset, hint=REPLAN_HINT)


def _stored(record: ExtractionPlan, shards: tuple[int, int]) -> tuple[PreparedDataset | None, str]:
    """The rows from the stored plan the plan names, or the one of this host's output; (None, why not)."""
    # the plan's, else one a range kept where this host writes (a fan-out spool)
    places = [] if record.stored_plan is None else [Path(record.stored_plan),
                                                    stored.plan_dir(record.spec.out, record.fingerprint)]
    sha256 = file_fingerprint(record.spec.dataset)
    _check_dataset(record, sha256)
    pre = record.resolved.preprocessing
    why = "the plan keeps no stored plan (image rows are planned again)"
    for d in dict.fromkeys(places):
        index = stored.read_index(d, record.fingerprint)
        if index is None or index.get("dataset_sha256") != sha256 or tuple(index.get("boundaries", ())) != record.boundaries:
            why = f"no whole stored plan of this plan in {d}"
            continue
        try:
            return stored.stored_dataset(record.spec, d, index, shards, record.boundaries,
                                         hashes=lambda: (pre.chat_template_sha256, pre.tokenizer_sha256)), f"loaded from {d}"
        except (stored.StoredPlanError, KeyError, TypeError, ValueError) as e:
            why = f"{d}: {e}"
    return None, why


def _tokenized(record: ExtractionPlan, info: ModelInfo) -> PreparedDataset:
    """Every row tokenized again, as `datagen plan` did: refused unless the tokens are the plan's."""
    from datagen.models.tokenizer import load_tokenizer

    spec = record.spec
    data = prepare_dataset(spec.dataset, vocab_size=info.vocab_size, max_seq_len=spec.max_seq_len,
                           load_tokenizer=lambda: load_tokenizer(spec.model, tokenizer=spec.tokenizer,
                                                                 trust_remote_code=spec.engine.trust_remote_code))
    _check_dataset(record, data.fingerprint)
    pre = record.resolved.preprocessing
    tokens = [len(data.samples[r].input_ids) if r in data.samples else 0 for r in range(data.rows)]
    if ((data.chat_template_hash, data.tokenizer_hash) != (pre.chat_template_sha256, pre.tokenizer_sha256)
            or data.rows != record.rows or ShardCut.of_rows(record.boundaries, tokens).tokens != record.tokens):
        raise CannotRunHereError("this host tokenizes the dataset otherwise than the plan's host did (another "
                                 "tokenizer, chat template or library version)",
                                 hint="give this host the plan's tokenizer and image, or " + REPLAN_HINT)
    return data
