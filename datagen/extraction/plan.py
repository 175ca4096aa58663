"""The plan of an extraction: a spec checked against the model's config and the tokenized dataset,
with its fingerprints and shard keys. Everything here is checked without loading a weight, so a bad
spec is refused before a GPU is touched.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from datagen.data.contract import LAYER_NUMBERING, ResolvedSpec, ShardFormat, state_bytes
from datagen.data.dataset import PreparedDataset
from datagen.data.media import media_samples
from datagen.data.planning import prepare_dataset
from datagen.storage import s3 as _s3_images  # noqa: F401 (registers the reader of s3:// image urls)
from datagen.specs.extraction import (
    DEFAULT_MAX_SEQ_LEN, EngineName, ExtractSpec, ShardSizing, canonical_json, check_shard_size, default_layer_ids, sha256_hex,
)
from datagen.errors import SpecError
from datagen.extraction.boundaries import byte_boundaries, byte_shard_group, row_boundaries
from datagen.specs.plan import ExtractionPlan, ShardCut, plan_dir
from datagen.models.modelinfo import ModelInfo, check_layer_ids, inspect_model, model_content_hash


@dataclass(frozen=True)
class Plan:
    """A plan at work in one process: the plan record (``ExtractionPlan``, what `datagen plan` made),
    the model's config as this host reads it, and the dataset's rows (of the shards at hand)."""

    record: ExtractionPlan
    info: ModelInfo
    data: PreparedDataset

    @property
    def spec(self) -> ExtractSpec:
        return self.record.spec

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The resolved ids (the order of the stored layer axis)."""
        return self.record.layer_ids

    @cached_property
    def shard_format(self) -> ShardFormat:
        """The plan's shard format, one object: the engine's and every shard job's."""
        return self.record.shard_format

    @property
    def engine_desc(self) -> dict:
        return self.record.engine

    @property
    def resolved_spec(self) -> ResolvedSpec:
        """What the manifest records."""
        return self.record.resolved

    @property
    def extraction_fingerprint(self) -> str:
        return self.record.extraction_fingerprint

    @property
    def fingerprint(self) -> str:
        return self.record.fingerprint

    @property
    def cut(self) -> ShardCut:
        """Where shards start and their tokens (datagen.extraction.boundaries)."""
        return self.record.cut

    @property
    def shard_group(self) -> int:
        """The engine's shard group: the spec's, else resolved (recorded in resolved_spec.engine)."""
        return self.record.shard_group

    @property
    def boundaries(self) -> tuple[int, ...]:
        """(0, b_1, ..., rows): shard k holds rows [b_k, b_k+1)."""
        return self.cut.boundaries

    @property
    def num_shards(self) -> int:
        return len(self.boundaries) - 1

    def shard_range(self, k: int) -> tuple[int, int]:
        """Shard k's first row and its rows (kept and skipped)."""
        return self.boundaries[k], self.boundaries[k + 1] - self.boundaries[k]

    def shard_of_row(self, row: int) -> int:
        """The shard holding dataset row ``row``."""
        return bisect.bisect_right(self.boundaries, row) - 1

    @property
    def state_bytes(self) -> int:
        """Bytes of stored states per token (``datagen.data.contract.state_bytes``)."""
        return self.record.state_bytes

    @property
    def volume_dirs(self) -> tuple[Path, ...]:
        """The output volumes, absolute: ``out`` first, then the spec's further volumes."""
        return (Path(self.spec.out).absolute(), *(Path(v).absolute() for v in self.spec.volumes))

    def volume_of(self, k: int) -> int:
        """The volume shard k is written to: k mod the number of volumes."""
        return k % (1 + len(self.spec.volumes))

    def shard_dir(self, k: int) -> Path:
        """The volume root shard k's record path is relative to."""
        return self.volume_dirs[self.volume_of(k)]

    def shard_key(self, k: int) -> str:
        return self.record.shard_keys[k]


def shard_key(extraction_fingerprint: str, k: int, first: int, count: int, rows_hash: str) -> str:
    """The cache key of shard k: the extraction fingerprint, the shard's place and its rows' hash."""
    return sha256_hex(f"{extraction_fingerprint}:{k}:{first}:{count}:{rows_hash}")


def describe_shards(p: Plan) -> str:
    """One line on the plan's shards: how many, how they are sized, what they weigh, the group."""
    w = p.record.shard_weights
    sizing = (f"{p.spec.samples_per_shard} rows each" if p.spec.shard_sizing is ShardSizing.ROWS
              else f"target {p.spec.resolved_shard_bytes / 1e9:.3g} GB of states")
    return (f"{p.num_shards} shards ({sizing}), states {w['min'] / 1e9:.3g} / {w['median'] / 1e9:.3g} / "
            f"{w['max'] / 1e9:.3g} GB min / median / max, shard group {p.shard_group}")


def describe_engine(spec: ExtractSpec, info: ModelInfo) -> dict:
    """Engine name, version, patches and attention backend without starting it (part of the
    fingerprint). The vLLM engine checks, once started, that its worker runs that backend."""
    if spec.engine.name is EngineName.VLLM:
        from datagen.engines import patches
        from datagen.engines.capture_paths import choose_path, model_runner
        from datagen.engines.vllm_attention import choose_attention_backend, is_cpu_build

        version = patches.check_vllm_version()
        path = choose_path(version)
        return {"name": "vllm", "version": version, "patches": patches.patch_names(),
                "attention_backend": choose_attention_backend(info, spec.engine.mla_backend),
                "capture_path": path,
                "model_runner": model_runner(version, path, cpu_build=is_cpu_build(), architecture=info.architecture,
                                             tensor_parallel_size=spec.engine.tensor_parallel_size)}
    import transformers

    return {"name": "hf", "version": transformers.__version__, "patches": []}


def resolve_max_seq_len(spec: ExtractSpec, info: ModelInfo) -> int:
    """The spec's max_seq_len; when it names none, the default, lowered to fit the model.

    Raises:
        SpecError: an explicit max_seq_len that does not fit the model's positions.
    """
    positions = info.max_position_embeddings
    if spec.max_seq_len is None:
        # the prompt plus the one sampled token must fit the model's positions
        return min(DEFAULT_MAX_SEQ_LEN, positions - 1) if positions and positions >= 3 else DEFAULT_MAX_SEQ_LEN
    if positions and spec.max_seq_len >= positions:
        raise SpecError(
            f"max_seq_len {spec.max_seq_len} does not fit the model's {positions} positions",
            hint=f"use --max-seq-len {positions - 1} or less, or leave it out (the default fits the model)",
        )
    return spec.max_seq_len


@dataclass(frozen=True)
class Header:
    """What a plan knows before it reads the dataset: the spec (max_seq_len resolved), the
    model's config, the layers and the engine, and how to load the tokenizer."""

    spec: ExtractSpec
    info: ModelInfo
    layer_ids: tuple[int, ...]
    engine_desc: dict

    def load_tokenizer(self):
        from datagen.models.tokenizer import load_tokenizer

        return load_tokenizer(self.spec.model, tokenizer=self.spec.tokenizer,
                              trust_remote_code=self.spec.engine.trust_remote_code)


def plan_header(spec: ExtractSpec) -> Header:
    """Everything of a plan that does not read the dataset (the model's config, the layers, the
    engine): checked here, as ``plan`` checks it.

    Raises:
        SpecError: the spec sizes its shards both by bytes and by rows, or the model refuses it.
    """
    try:
        check_shard_size(spec.shard_bytes, spec.samples_per_shard)
    except ValueError as e:
        raise SpecError(str(e), hint="drop --shard-bytes or --samples-per-shard") from None
    info = inspect_model(spec.model, trust_remote_code=spec.engine.trust_remote_code)
    # the one place the layer ids are resolved: the default filled in, checked against the model
    layer_ids = tuple(spec.layer_ids or default_layer_ids(info.num_hidden_layers))
    check_layer_ids(layer_ids, info)
    if spec.engine.name is EngineName.VLLM:  # from the config alone: the text decoder, not the wrapper
        from datagen.engines import patches

        patches.check_capturable(info.model_type, info.num_hidden_layers, layer_ids, patches.installed_vllm_version(),
                                 model=spec.model)
    spec = spec.model_copy(update={"max_seq_len": resolve_max_seq_len(spec, info)})
    return Header(spec, info, layer_ids, describe_engine(spec, info))


def plan(spec: ExtractSpec) -> Plan:
    """Check everything that can be checked without loading a weight."""
    h = plan_header(spec)
    data = prepare_dataset(h.spec.dataset, load_tokenizer=h.load_tokenizer, vocab_size=h.info.vocab_size,
                           max_seq_len=h.spec.max_seq_len)
    return plan_from(h, data)


def plan_from(h: Header, data: PreparedDataset, *, cut: ShardCut | None = None) -> Plan:
    """The plan of a header and its dataset: fingerprints, shard boundaries, the spec the manifest
    records. The fingerprint covers everything that shapes the tokens (the dataset's bytes, the
    tokenizer and its chat template, max_seq_len), the model, the layers, the engine and the shard size.

    ``cut``: the shards' boundaries and tokens when ``data`` holds the samples of some shards only (a
    stored plan's, which recorded them); else they are cut here from every row's token count."""
    spec, info, layer_ids, engine_desc = h.spec, h.info, h.layer_ids, h.engine_desc
    model_identity = spec.model_revision or f"content:{model_content_hash(info)}"
    storage_dtype = spec.engine.resolved_storage_dtype
    per_token = state_bytes(storage_dtype, n_layers=len(layer_ids), hidden_size=info.hidden_size)
    # Rows per shard record what they always recorded (the fingerprints of datasets cut so stay as
    # they were); a size in bytes records the target. The shard group is recorded as resolved.
    if spec.shard_sizing is ShardSizing.ROWS:
        sizing = {"samples_per_shard": spec.samples_per_shard}
        group = spec.engine.shard_group or 1
    else:
        sizing = {"shard_bytes": spec.resolved_shard_bytes}
        group = spec.engine.shard_group or byte_shard_group(spec.resolved_shard_bytes, bytes_per_token=per_token,
                                                            step_tokens=spec.engine.max_num_batched_tokens)
    extraction = {
        "model": {"revision": model_identity, "architecture": info.architecture,
                  "num_hidden_layers": info.num_hidden_layers, "hidden_size": info.hidden_size},
        "layer_ids": list(layer_ids),
        "layer_numbering": LAYER_NUMBERING,
        "dtype": spec.engine.dtype,
        "storage_dtype": storage_dtype,
        "preprocessing": {"max_seq_len": spec.max_seq_len, "chat_template_sha256": data.chat_template_hash,
                          "tokenizer_sha256": data.tokenizer_hash, **sizing},
        "engine": {**engine_desc, **spec.engine.model_dump(mode="json", exclude={"dtype", "storage_dtype"}),
                   "shard_group": group},
    }
    extraction_fp = sha256_hex(canonical_json(extraction))
    dataset = {"source": str(Path(spec.dataset).resolve()), "sha256": data.fingerprint, "rows": data.rows,
               "format": data.format}
    fingerprint = sha256_hex(canonical_json({"extraction": extraction_fp, "dataset": data.fingerprint}))
    resolved = ResolvedSpec.model_validate(
        {**extraction, "model": {**extraction["model"], "source": str(Path(spec.model).resolve())}, "dataset": dataset})
    if cut is None:
        cut = cut_shards(spec, data, bytes_per_token=per_token)
    keys = tuple(shard_key(extraction_fp, k, a, b - a, data.shard_rows_hash(a, b - a))
                 for k, (a, b) in enumerate(zip(cut.boundaries, cut.boundaries[1:])))
    # where its tokenized rows are (or will be) kept; image rows are planned again (not stored)
    kept = None if media_samples(data) else str(plan_dir(spec.out, fingerprint).absolute())
    record = ExtractionPlan(spec=spec, resolved=resolved, engine=engine_desc, fingerprint=fingerprint,
                            extraction_fingerprint=extraction_fp, boundaries=cut.boundaries, tokens=cut.tokens,
                            shard_keys=keys, shard_group=group, stored_plan=kept)
    return Plan(record, info, data)


def cut_shards(spec: ExtractSpec, data: PreparedDataset, *, bytes_per_token: int) -> ShardCut:
    """``data``'s shards as ``spec`` sizes them (every sample of ``data`` loaded)."""
    tokens = [len(data.samples[r].input_ids) if r in data.samples else 0 for r in range(data.rows)]
    if spec.shard_sizing is ShardSizing.ROWS:
        boundaries = row_boundaries(data.rows, spec.samples_per_shard)
    else:
        boundaries = byte_boundaries(tokens, data.line_hashes, bytes_per_token=bytes_per_token,
                                     target=spec.resolved_shard_bytes)
    return ShardCut.of_rows(boundaries, tokens)
