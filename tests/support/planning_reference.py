"""Planning as it was before planning ran in worker processes: one process, every prefix rendered
one call at a time, the whole render tokenized a second time for every row. Kept verbatim (only
renamed) as the oracle that the planner's output is compared with, byte for byte. Rows are brought
to their normal form first (``datagen.data.row_formats``), and a row's identity is the planner's
``row_identity`` of it (the one definition of it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from datagen.data.contract import SkippedRow, TruncatedRow
from datagen.data.chat_template import TARGET_ROLE
from datagen.data.chat_tokens import _tokenize_by_offsets
from datagen.data.dataset import PreparedDataset, Sample, TokenizerLoader, read_rows, tokenizer_hashes
from datagen.data.planning_rows import row_identity
from datagen.data.row_checks import _check_messages, _check_tokens_row
from datagen.data.row_formats import normalise
from datagen.errors import DatasetError, ModelError


def reference_target_spans(tokenizer, messages: list[dict], *, path: str = "", line: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The whole chat's render and the character spans of its assistant targets.

    The template is rendered for each prefix of the chat: the text between the prompt for
    assistant turn i (``add_generation_prompt=True``) and the render that includes turn i is that
    turn's target (thinking block, content, tool calls and end-of-turn marker, whatever the
    template writes after the prompt). Both renders must be prefixes of the whole chat's.
    """
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != TARGET_ROLE:
            continue
        start_text = render(messages[:i], True)
        end_text = render(messages[: i + 1], False)
        if not full.startswith(start_text) or not full.startswith(end_text) or len(end_text) < len(start_text):
            raise DatasetError(
                f"the chat template renders the chat up to message {i} differently from the whole chat "
                "(it is not a prefix of it: the template rewrites earlier turns, e.g. drops their "
                "reasoning), so assistant tokens cannot be located",
                path=path, line=line,
                hint="split the chat at that turn, or pre-tokenize this dataset with input_ids and loss_mask",
            )
        if spans and len(start_text) < spans[-1][1]:
            raise DatasetError(f"assistant message {i} starts before the previous one ends in the render",
                               path=path, line=line, hint="pre-tokenize this dataset with input_ids and loss_mask")
        spans.append((len(start_text), len(end_text)))
    return full, spans


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def reference_tokenize_chat(tokenizer, messages: list[dict], *, path: str = "", line: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and the assistant loss mask of one chat, with any tokenizer (slow or fast).

    The render is cut at the targets' boundaries and tokenized piece by piece; the pieces'
    tokens concatenated must equal the whole render's tokenization, which makes the mask exact
    (no token straddles a boundary). Chat templates put a special token or a newline at every
    turn boundary, where BPE does not merge; a tokenizer that merges across one anyway is read
    by character offsets when it is a fast tokenizer (a token is a target when its first
    character is), and refused otherwise.
    """
    full, spans = reference_target_spans(tokenizer, messages, path=path, line=line)
    cuts = sorted({0, len(full), *(c for span in spans for c in span)})
    ids: list[int] = []
    mask: list[int] = []
    for a, b in zip(cuts, cuts[1:]):
        piece = _ids(tokenizer, full[a:b])
        target = any(s <= a and b <= e for s, e in spans)
        ids.extend(piece)
        mask.extend([int(target)] * len(piece))
    whole = _ids(tokenizer, full)
    if whole == ids:
        return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)
    if getattr(tokenizer, "is_fast", False):
        return _tokenize_by_offsets(tokenizer, full, spans)
    first = next((k for k, (x, y) in enumerate(zip(ids, whole)) if x != y), min(len(ids), len(whole)))
    raise DatasetError(
        f"the tokenizer merges tokens across an assistant turn's boundary (token {first} differs when "
        "the turns are tokenized apart), and as a slow tokenizer it gives no character offsets",
        path=path, line=line,
        hint="end turns with a special token in the chat template, or pre-tokenize this dataset",
    )


def reference_prepare_dataset(
    path: str | Path,
    *,
    load_tokenizer: TokenizerLoader,
    vocab_size: int,
    max_seq_len: int,
) -> PreparedDataset:
    """Read, check and tokenize every row. Raises DatasetError on the first bad row."""
    p = Path(path)
    # The fingerprint is of the bytes parsed, not of a second read: a file changed in between
    # would otherwise get a fingerprint that its shards were not extracted from.
    digest = hashlib.sha256()
    rows = read_rows(p, digest=digest)
    fingerprint = digest.hexdigest()
    samples: dict[int, Sample] = {}
    skipped: list[SkippedRow] = []
    truncated: list[TruncatedRow] = []
    kinds: set[str] = set()
    tokenizer = None
    normals = []
    for row, _raw, obj in rows:
        line = row + 1
        obj = normalise(obj, path=str(p), line=line)[1]
        normals.append(obj)
        if "messages" in obj:
            msgs = _check_messages(obj, path=str(p), line=line)
            kinds.add("chat")
            if not msgs:
                skipped.append(SkippedRow(row=row, reason="empty"))
                continue
            if tokenizer is None:
                tokenizer = load_tokenizer()
            ids, mask = reference_tokenize_chat(tokenizer, msgs, path=str(p), line=line)
        elif "input_ids" in obj:
            ids, mask = _check_tokens_row(obj, path=str(p), line=line, vocab_size=vocab_size)
            kinds.add("tokens")
        else:
            raise DatasetError(
                f"row has neither 'messages' nor 'input_ids' (fields: {sorted(obj)})",
                path=str(p), line=line,
                hint='write {"messages": [...]} or {"input_ids": [...], "loss_mask": [...]}',
            )
        if len(ids) == 0:
            skipped.append(SkippedRow(row=row, reason="empty"))
            continue
        if len(ids) > max_seq_len:
            truncated.append(TruncatedRow(row=row, original_tokens=len(ids), kept_tokens=max_seq_len))
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not mask.any():
            skipped.append(SkippedRow(row=row, reason="no_target"))
            continue
        if tokenizer is not None and int(ids.max()) >= vocab_size:
            raise ModelError(
                f"the tokenizer produced id {int(ids.max())} but the model's vocabulary has "
                f"{vocab_size} entries", hint="use the tokenizer that belongs to this model",
            )
        samples[row] = Sample(row=row, input_ids=ids, loss_mask=mask)
    if not samples:
        # Every row skipped: a run would start an engine, store nothing and call it complete.
        reasons = sorted({s.reason for s in skipped})
        raise DatasetError(
            f"no row has a target token: all {len(rows)} rows would be skipped ({', '.join(reasons)})",
            path=str(p),
            hint="give chat rows an assistant turn, or pre-tokenized rows a loss_mask with 1s",
        )
    template_hash, tok_hash = tokenizer_hashes(tokenizer) if tokenizer is not None else (None, None)
    return PreparedDataset(
        path=str(p),
        rows=len(rows),
        fingerprint=fingerprint,
        samples=samples,
        skipped=skipped,
        truncated=truncated,
        line_hashes=[row_identity(n, p.parent) for n in normals],
        chat_template_hash=template_hash,
        tokenizer_hash=tok_hash,
        kinds=kinds,
    )
