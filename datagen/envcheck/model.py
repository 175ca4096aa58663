"""The model as the env check sees it: its config and size, read without downloading weights,
and whether the spec's layer ids fit its depth."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from datagen.specs.extraction import default_layer_ids
from datagen.envcheck.report import Check, Status
from datagen.errors import CannotRunHereError
from datagen.storage.model_cache import ModelCache, cache_key
from datagen.specs.source import HubSource, LocalSource, S3Source, SourcesSpec
from datagen.storage.model_files import file_set_name, needed_files


@dataclass(frozen=True)
class ModelFacts:
    config: dict  # config.json
    total_bytes: int | None  # the engine's files; None when unknown (Hub offline, not cached)
    cached: bool  # already complete in the model cache (or local): nothing to download


def text_config(cfg: dict) -> dict:
    """The text decoder's config: ``text_config`` of a multimodal wrapper (Kimi-K2.5), else the config."""
    return cfg.get("text_config") or cfg


# -- reading the model without downloading it -------------------------------------------------


def _facts_local(src: LocalSource, trust: bool) -> ModelFacts:
    d = src.path
    if not (d / "config.json").is_file():
        raise CannotRunHereError(f"{d} has no config.json", hint="point the spec's model at a Hugging Face model directory")
    rels = needed_files([p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()], trust_remote_code=trust)
    return ModelFacts(json.loads((d / "config.json").read_text()), sum((d / r).stat().st_size for r in rels), True)


def _facts_s3(src: S3Source, trust: bool, cache: ModelCache) -> ModelFacts:
    from datagen.storage import s3
    from datagen.storage.s3_mirror import list_mirror

    client = s3.make_client()
    mirror = list_mirror(client, src, trust_remote_code=trust)
    config = json.loads(s3.get_bytes(client, src.bucket, f"{src.prefix}/config.json" if src.prefix else "config.json"))
    cached = cache.read_verified(cache_key(src.uri, mirror.revision, file_set_name(trust_remote_code=trust))) is not None
    return ModelFacts(config, mirror.bytes, cached)


def _facts_hub(src: HubSource, trust: bool, cache: ModelCache) -> ModelFacts:
    from huggingface_hub import errors as hf
    from huggingface_hub import hf_hub_download

    from datagen.storage.hub import _translate_hub_error, resolve_revision

    sha = resolve_revision(src, cache)
    try:
        config_path = hf_hub_download(src.repo_id, "config.json", revision=sha, cache_dir=cache.hub_dir)
    except (hf.HfHubHTTPError, hf.LocalEntryNotFoundError, OSError) as e:
        raise _translate_hub_error(e, src) from e
    record = cache.read_verified(cache_key(f"hf://{src.repo_id}", sha, file_set_name(trust_remote_code=trust)))
    if record is not None:
        return ModelFacts(json.loads(Path(config_path).read_text()), record.bytes, True)
    return ModelFacts(json.loads(Path(config_path).read_text()), _hub_bytes(src, sha, cache, trust), False)


def _hub_bytes(src: HubSource, sha: str, cache: ModelCache, trust: bool) -> int | None:
    """Size of the engine's files of a Hub repo: the cached tree listing, else the Hub's."""
    from huggingface_hub import HfApi, constants, get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        sizes = {f.path: f.size for f in get_cached_repo_tree(src.repo_id, revision=sha, cache_dir=cache.hub_dir)}
    except CachedRepoTreeNotFoundError:
        if constants.HF_HUB_OFFLINE:
            return None
        info = HfApi().model_info(src.repo_id, revision=sha, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    return sum(sizes[r] for r in needed_files(list(sizes), trust_remote_code=trust))


def read_model_facts(spec: SourcesSpec, cache: ModelCache) -> ModelFacts:
    src, trust = spec.source, spec.engine.trust_remote_code
    if isinstance(src, LocalSource):
        return _facts_local(src, trust)
    if isinstance(src, S3Source):
        return _facts_s3(src, trust, cache)
    return _facts_hub(src, trust, cache)


# -- the model's depth against the spec's layer ids ---------------------------------------------


def check_layers(spec: SourcesSpec, config: dict) -> tuple[Check, tuple[int, ...] | None, int | None]:
    text = text_config(config)
    try:
        n, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    except (KeyError, TypeError, ValueError) as e:
        return (
            Check(name="model_config", status=Status.FAILED, detail=f"config.json lacks {e}", fix="use a complete Hugging Face config"),
            None,
            None,
        )
    ids = spec.layer_ids or default_layer_ids(n)
    bad = [i for i in ids if i > n]
    if bad:
        return (
            Check(
                name="model_config",
                status=Status.FAILED,
                detail=f"layer ids {bad} are out of range for a {n}-layer model (valid: 0..{n}; {n} = last layer's output)",
                fix=f"set layer_ids to ids in 0..{n}, e.g. the EAGLE-3 default {list(default_layer_ids(n))}",
            ),
            None,
            hidden,
        )
    return (
        Check(name="model_config", status=Status.OK, detail=f"{n} layers, hidden size {hidden}, layer ids {list(ids)}"),
        tuple(ids),
        hidden,
    )
