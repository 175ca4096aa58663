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

This module holds what a row's images are (``MediaItem``, the skip reasons), the checks of its
parts and the images of a plan. The rest, by concern: ``media_fetch`` (an image's bytes: read from
a path or a remote store, decoded), ``media_identity`` (a row's identity with its images' bytes),
``media_processor`` (vLLM's image processor and its count of an image's tokens),
``media_tokens`` (an image row planned: placeholders expanded; and collapsed again for the
engine's prompt) and ``media_sources`` (where a dataset's images are, for the step containers).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from datagen.errors import DatasetError

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


# --- a plan's images ----------------------------------------------------------------------------

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
