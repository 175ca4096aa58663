"""What a model directory is, read from its files without loading a weight."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

from datagen.errors import ModelError, ModelNotFoundError

log = logging.getLogger(__name__)

# Architectures whose vLLM implementation exposes aux hidden states (SupportsEagle3) and
# whose transformers implementation the reference engine runs. Checked before the engine
# starts; vLLM's own registry is asked too when vLLM is installed (engines.patches).
CAPTURE_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV2ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "MistralForCausalLM",
    }
)
# Safetensors headers larger than this are refused: a hostile file can claim a huge header.
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
# Bits per element of every safetensors dtype (safetensors 0.6): a header naming another dtype,
# or offsets that disagree with a tensor's shape, is corrupt (the engine would fail on it later).
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}
# Files up to this size are hashed whole for the content fingerprint; larger weight files
# contribute their size, safetensors header and first and last MiB (hashing a 600 GB
# checkpoint on every run would cost more than the run).
FULL_HASH_LIMIT = 256 * 1024 * 1024


@dataclass(frozen=True)
class ModelInfo:
    """The facts about a model that the spec is checked against."""

    path: str
    architecture: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int | None
    weight_files: tuple[str, ...]
    has_tokenizer: bool
    wants_remote_code: bool
    # What vLLM runs: the decoder's architecture inside a multimodal wrapper (Kimi-K2.5:
    # KimiK25ForConditionalGeneration around a DeepseekV3ForCausalLM), and the weights'
    # quantization (in the real Kimi-K2.5 checkpoint, inside text_config).
    text_architecture: str | None = None
    quantization: str | None = None  # "compressed-tensors pack-quantized int4 group 32", None = unquantized

    @property
    def multimodal(self) -> bool:
        """A multimodal wrapper around its decoder (config.json's text_config: Kimi-K2.5)."""
        return self.text_architecture not in (None, self.architecture)


def _text_config(cfg: dict) -> dict:
    # Multimodal wrappers (Kimi-K2.5) nest the language model's config.
    return cfg.get("text_config") or cfg


def describe_quantization(cfg: dict) -> str | None:
    """The checkpoint's quantization in words, from config.json (top level or text_config), or None."""
    q = cfg.get("quantization_config") or _text_config(cfg).get("quantization_config")
    if not isinstance(q, dict):
        return None
    words = [str(q.get("quant_method", "quantized"))]
    if q.get("format"):
        words.append(str(q["format"]))
    groups = q.get("config_groups") or {}
    for g in groups.values() if isinstance(groups, dict) else []:
        w = (g or {}).get("weights") or {}
        if w.get("num_bits"):
            words.append(f"{w.get('type', 'int')}{w['num_bits']}")
        if w.get("group_size"):
            words.append(f"group {w['group_size']}")
        break
    return " ".join(words)


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file; ModelError when it is not one."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelError(f"weight file {path.name} is truncated (no header)", hint="download it again")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_SAFETENSORS_HEADER:
                raise ModelError(
                    f"weight file {path.name} claims a {n}-byte header (limit {MAX_SAFETENSORS_HEADER})",
                    hint="the file is corrupt or hostile; download it again from a trusted source",
                )
            raw = f.read(n)
    except OSError as e:
        raise ModelError(f"cannot read weight file {path}: {e}", hint="check the file") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelError(f"weight file {path.name} has a corrupt header", hint="download it again") from None
    if not isinstance(header, dict):
        raise ModelError(f"weight file {path.name} has a corrupt header (not a JSON object)", hint="download it again")
    for name, entry in header.items():
        if name != "__metadata__" and (problem := _entry_problem(entry)):
            raise ModelError(f"weight file {path.name} has a corrupt header: tensor {name!r} {problem}",
                             hint="download it again")
    size = path.stat().st_size
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    end = 0
    for begin, stop in spans:  # the tensors must tile the data, as safetensors requires to load it
        if begin != end:
            raise ModelError(f"weight file {path.name} has a corrupt header: tensor data "
                             f"{'overlaps' if begin < end else 'has a hole'} at byte {8 + n + min(begin, end)}",
                             hint="download it again")
        end = stop
    if 8 + n + end > size:
        raise ModelError(
            f"weight file {path.name} is truncated: {size} bytes, header says {8 + n + end}",
            hint="download it again",
        )
    if 8 + n + end < size:
        raise ModelError(
            f"weight file {path.name} is corrupt: {size} bytes, {size - 8 - n - end} more than its header describes",
            hint="download it again",
        )
    return header


def _entry_problem(entry) -> str | None:
    """What is wrong with one tensor's header entry, or None."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        return "lacks dtype, shape or data_offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in SAFETENSORS_DTYPE_BITS:
        return f"has unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"has shape {shape!r}, not a list of non-negative integers"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return f"has data_offsets {offsets!r}, not [begin, end]"
    numel = 1
    for d in shape:
        numel *= d
    if (offsets[1] - offsets[0]) * 8 != numel * SAFETENSORS_DTYPE_BITS[dtype]:
        return f"has {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}"
    return None


def _plain_name(name: str) -> bool:
    """A relative path inside its directory: no absolute path, no '..', no backslash, not empty."""
    from pathlib import PurePosixPath

    p = PurePosixPath(name)
    return bool(name) and "\\" not in name and not p.is_absolute() and ".." not in p.parts and "\0" not in name


def _weight_files(d: Path) -> tuple[str, ...]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelError(f"{index.name} is corrupt: {e}", hint="download the model again") from e
        # the index is data: a name must not lead out of the model directory
        unsafe = [n for n in names if not isinstance(n, str) or not _plain_name(n)]
        if unsafe:
            from datagen.errors import UnsafePathError

            raise UnsafePathError(
                f"{index.name} names weight files outside the model directory or not file names: {unsafe[:3]}",
                hint="the index is corrupt or hostile; download the model again from a trusted source",
            )
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ModelNotFoundError(
                f"model {d} is missing weight files {missing[:3]}{'...' if len(missing) > 3 else ''}",
                hint="download the model again (datagen download)",
            )
        return tuple(names)
    names = tuple(sorted(p.name for p in d.glob("*.safetensors")))
    if not names:
        raise ModelNotFoundError(
            f"model {d} has no safetensors weights", hint="convert the checkpoint to safetensors"
        )
    return names


def inspect_model(path: str | Path, *, trust_remote_code: bool = False) -> ModelInfo:
    """Read config.json and check the weight files' headers. Loads no weights."""
    d = Path(path)
    if not d.is_dir():
        raise ModelNotFoundError(
            f"model directory {d} does not exist", hint="pass a local Hugging Face model directory with --model"
        )
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{d} has no config.json", hint="is this a Hugging Face model directory?")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{cfg_path} is not valid JSON: {e}", hint="download the model again") from e
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else "(none)"
    wants_remote = bool(cfg.get("auto_map"))
    if wants_remote and not trust_remote_code and arch not in CAPTURE_ARCHITECTURES:
        raise ModelError(
            f"model {d} asks to run its own Python code (auto_map in config.json) and the spec does not allow it",
            hint="set engine.trust_remote_code=true only for a model source you trust",
        )
    if arch not in CAPTURE_ARCHITECTURES:
        raise ModelError(
            f"architecture {arch} cannot be captured: hidden-state capture is supported for "
            f"{', '.join(sorted(CAPTURE_ARCHITECTURES))}",
            hint="use a model of a supported architecture",
        )
    text = _text_config(cfg)
    try:
        n_layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
        vocab = int(text["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{cfg_path} lacks {e}", hint="the config must name num_hidden_layers, hidden_size, vocab_size") from e
    files = _weight_files(d)
    for name in files:
        read_safetensors_header(d / name)
    has_tok = has_tokenizer_files(d)
    return ModelInfo(
        path=str(d.resolve()),
        architecture=arch,
        model_type=str(text.get("model_type", cfg.get("model_type", ""))),
        num_hidden_layers=n_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        max_position_embeddings=text.get("max_position_embeddings"),
        weight_files=files,
        has_tokenizer=has_tok,
        wants_remote_code=wants_remote,
        text_architecture=(text.get("architectures") or [None])[0] if text is not cfg else arch,
        quantization=describe_quantization(cfg),
    )


# A tokenizer's own files: fast (tokenizer.json), sentencepiece, tiktoken ranks (Kimi's tiktoken.model,
# *.tiktoken), GPT-2 style vocab + merges.
TOKENIZER_FILE_GLOBS = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "*.tiktoken", "vocab.json", "spiece.model")


def has_tokenizer_files(d: Path) -> bool:
    """True when ``d`` holds a tokenizer transformers can load (a tokenizer class shipped as code,
    as Kimi-K2.5's, is named in tokenizer_config.json's auto_map and reads one of these files)."""
    return any(p.is_file() for g in TOKENIZER_FILE_GLOBS for p in d.glob(g))


def model_content_hash(info: ModelInfo) -> str:
    """Fingerprint of a local model directory by content (see FULL_HASH_LIMIT)."""
    d = Path(info.path)
    h = hashlib.sha256()
    names = sorted(
        p.name for p in d.iterdir()
        if p.is_file() and (p.suffix in {".json", ".jinja", ".model", ".py", ".txt", ".tiktoken"} or p.name in info.weight_files)
    )
    for name in names:
        p = d / name
        hash_file_sampled(h, p, name)
    return h.hexdigest()


def hash_file_sampled(h, path: Path, name: str) -> None:
    """Feed ``name``, the size and the content (or, past FULL_HASH_LIMIT, the first and last MiB)."""
    size = path.stat().st_size
    h.update(f"{name}\0{size}\0".encode())
    with path.open("rb") as f:
        if size <= FULL_HASH_LIMIT:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))


def check_layer_ids(layer_ids: tuple[int, ...], info: ModelInfo) -> None:
    """Layer ids must lie in [0, N] for an N-layer model."""
    n = info.num_hidden_layers
    bad = [i for i in layer_ids if i > n]
    if bad:
        from datagen.errors import SpecError

        raise SpecError(
            f"layer ids {bad} are out of range for {info.architecture} with {n} layers: valid ids are 0..{n} "
            f"(id {n} is the last layer's output before the final norm)",
            hint=f"the EAGLE-3 default for this model is {','.join(map(str, sorted({min(2, n), n // 2, max(n - 3, 0), n})))}",
        )
