"""The files of a model repo the engine needs: the download's allow-list, and the name of that selection
(part of the model cache key). Patterns are globs on paths relative to the repo's root; everything else
(original PyTorch .bin/.pt checkpoints, GGUF, images, READMEs) is not fetched."""

from __future__ import annotations

import fnmatch

# The files the engine needs from a model repo, as glob patterns on paths relative to its root.
# Everything else (original PyTorch .bin/.pt checkpoints, GGUF, images, READMEs) is not fetched.
CONFIG_FILES = ("config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json")
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "*.tiktoken",
    "tiktoken.model",
)
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja")
# Custom modelling / tokenizer code: fetched only when the spec allows trust_remote_code.
REMOTE_CODE_FILES = ("*.py",)


def engine_file_patterns(*, trust_remote_code: bool) -> tuple[str, ...]:
    """Glob patterns of the files the engine needs (the download's allow-list)."""
    patterns = CONFIG_FILES + WEIGHT_FILES + TOKENIZER_FILES + CHAT_TEMPLATE_FILES
    return patterns + REMOTE_CODE_FILES if trust_remote_code else patterns


def file_set_name(*, trust_remote_code: bool) -> str:
    """Names the file selection ``engine_file_patterns`` makes (part of the model cache key)."""
    return "engine+code" if trust_remote_code else "engine"


def needed_files(paths: list[str], *, trust_remote_code: bool) -> list[str]:
    """The subset of ``paths`` (relative, '/'-separated) that the engine needs, sorted."""
    patterns = engine_file_patterns(trust_remote_code=trust_remote_code)
    return sorted(p for p in paths if any(fnmatch.fnmatchcase(p, pat) for pat in patterns))
