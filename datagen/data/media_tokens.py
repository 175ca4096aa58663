"""Image rows as tokens: each image's placeholder expanded to vLLM's count when a row is planned
(``plan_row``), and collapsed back to the template's one for the engine's prompt (``engine_prompt``).
The loss mask is 0 on image tokens."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from datagen.data.media import PAD_TOKEN, TOO_LONG, MediaItem, MediaProblem, image_urls
from datagen.data.media_fetch import decode, load_image, read
from datagen.data.media_processor import ImageTokens, counter_for
from datagen.errors import DatasetError

log = logging.getLogger(__name__)


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


def plan_row(tokenizer, messages: list[dict], *, row: int, path: str, max_seq_len: int, tokenize_chat,
             counter: ImageTokens | None = None, line: int | None = None, tools: list[dict] | None = None):
    """One image row's outcome for planning: ("sample", ids, mask, None, items) or ("skipped", reason).

    The row's images are read, decoded and counted; the chat is tokenized as every chat is
    (``tokenize_chat``: datagen.data.chat_tokens's; datagen.data.row_checks checked the parts with
    datagen.data.media) and each
    image's placeholder expanded (``line``: the row's line in ``path``, default row + 1; ``tools``:
    the row's tool declarations). Raises DatasetError for what the row itself gets wrong.
    """
    line = line or row + 1
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
    ids, mask = tokenize_chat(tokenizer, messages, tools=tools, path=path, line=line)
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
