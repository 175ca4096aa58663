"""What a regeneration is asked to do: sampling, the policies for odd turns, chunks, the engine.

One pydantic model, ``RegenerationSettings``: the step's options (``datagen regenerate``'s
command line is made from it plus the model, dataset and output) and the ``regenerate: {...}``
block of a pipeline spec. Every field decides the bytes written, so every field enters the
regeneration's fingerprint.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from datagen.specs.extraction import StorageDtype, canonical_json, sha256_hex

FORMAT_VERSION = 1


class ToolRows(str, enum.Enum):
    """What happens to a row whose assistant turns carry tool calls."""

    # The row is left out and listed (reason ``tool_calls``): every assistant token of the output
    # is then the target model's own, which is what a draft is trained on.
    SKIP = "skip"
    # The text turns are regenerated; the tool-call turns are kept as written (the tool results
    # after them answer those calls, so a new call would not match them). Their tokens are still
    # targets in extraction: the lineage marks each kept turn.
    KEEP_TOOL_TURNS = "keep-tool-turns"


class OnLength(str, enum.Enum):
    """What happens to a turn that stops at ``max_new_tokens`` (or the model's window)."""

    KEEP = "keep"  # kept as generated, marked ``length`` in the lineage; later turns follow it
    # The chat is cut before that turn (and later turns are not generated); a row left with no
    # generated turn is skipped (reason ``length``).
    DROP = "drop"


class Layout(str, enum.Enum):
    """Which file of the output is the dataset that extraction reads (both are always written)."""

    # chats.jsonl: the regenerated chats, rendered by the chat template when extracted. Every
    # assistant token is a target, in the context the template gives a finished chat.
    CHATS = "chats"
    # turns.jsonl: one pre-tokenized row per generated turn, the exact prompt the engine was given
    # and the tokens it generated (loss mask 1 on those and the stop token): the context the target
    # sees when it serves. For templates that rewrite finished turns (Kimi-K2-Thinking renders every
    # finished turn with an empty think block) it is the only layout whose targets hold the
    # generated reasoning. docs/regeneration.md, "Layout".
    AS_GENERATED = "as-generated"


class RegenerationSettings(BaseModel):
    """How the assistant turns are generated. Part of the regeneration's fingerprint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(
        0.0, ge=0.0, le=10.0, description="Sampling temperature; 0 is greedy (top_p and top_k then stay at "
        "their defaults).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: the smallest token set whose "
                         "probability reaches top_p (1: off).")
    top_k: int = Field(0, ge=0, description="Sample among the top_k tokens only (0: off).")
    seed: int = Field(0, ge=0, lt=2**63, description="Seed of the run; each row's turns get their own seed "
                      "from it (row_seed), so a row's sample does not depend on the others.")
    max_new_tokens: int = Field(1024, ge=1, description="Most tokens generated per assistant turn.")
    on_length: OnLength = Field(
        OnLength.KEEP, description="A turn that hits max_new_tokens: keep (marked in the lineage) or drop "
        "(the chat is cut before it).")
    tool_rows: ToolRows = Field(
        ToolRows.SKIP, description="Rows whose assistant turns carry tool calls: skip (listed) or "
        "keep-tool-turns (regenerate the text turns, keep the tool-call turns as written).")
    reasoning_parser: str | None = Field(
        None, description="vLLM reasoning parser of a thinking model (kimi_k2, deepseek_r1, qwen3, ...): "
        "the generated reasoning goes to reasoning_content. None: the whole text is content.")
    max_model_len: int | None = Field(
        None, ge=2, description="The model's window in tokens (prompt plus generated). None: the "
        "model's max_position_embeddings. A turn whose prompt fills it is skipped and listed.")
    layout: Layout = Field(
        Layout.CHATS, description="The dataset extraction reads: chats (chats.jsonl, rendered by the chat "
        "template) or as-generated (turns.jsonl: per generated turn, the prompt ids the engine was given "
        "and the ids it generated; what a thinking model's template drops from finished turns is kept).")
    rows_per_chunk: int = Field(
        256, ge=1, description="Dataset rows per chunk: rows [k*C, (k+1)*C) are generated together, "
        "written as one file, and are the unit of resume.")
    dtype: StorageDtype = Field("bfloat16", description="Compute dtype of the engine.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per engine (vLLM tensor parallel).")
    max_num_seqs: int = Field(256, ge=1, description="vLLM's most requests per engine step.")
    max_num_batched_tokens: int = Field(8192, ge=16, description="vLLM's token budget per engine step.")
    trust_remote_code: bool = Field(False, description="Allow the model directory's own Python code to run.")

    @model_validator(mode="after")
    def _greedy_has_no_sampling_knobs(self) -> "RegenerationSettings":
        if self.temperature == 0 and (self.top_p != 1.0 or self.top_k != 0):
            raise ValueError(
                f"temperature 0 is greedy decoding, which ignores top_p ({self.top_p}) and top_k ({self.top_k}): "
                "give a temperature > 0 to sample, or leave top_p and top_k out")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sampling(self) -> dict:
        """The sampling settings as the manifest records them."""
        if self.greedy:
            return {"method": "greedy", "max_new_tokens": self.max_new_tokens}
        return {"method": "sample", "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": self.seed, "seed_rule": "row_seed(seed, row, message)", "max_new_tokens": self.max_new_tokens}


def row_seed(seed: int, row: int, message: int) -> int:
    """The sampling seed of the turn at ``message`` of dataset row ``row``: a function of the run's
    seed and the turn alone (not of the batch or the chunk), 63 bits."""
    return int(sha256_hex(f"{seed}:{row}:{message}")[:16], 16) >> 1


def fingerprint(settings: RegenerationSettings, *, source_sha256: str, model_revision: str, engine: dict,
                tokenizer: dict) -> str:
    """The identity of a regeneration: what decides its bytes.

    Args:
        source_sha256: sha256 of the input JSONL.
        model_revision: the model's revision or content hash.
        engine: the engine's name and version.
        tokenizer: the chat template's and the tokenizer's hashes.
    """
    return sha256_hex(canonical_json({
        "format": FORMAT_VERSION, "source_sha256": source_sha256, "model_revision": model_revision,
        "settings": settings.model_dump(mode="json"), "engine": engine, "tokenizer": tokenizer,
    }))
