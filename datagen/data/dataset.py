"""Reading a JSONL dataset into token ids and loss masks.

A row is either a chat ``{"messages": [{"role", "content"}, ...]}``, tokenized
with the model's chat template (``loss_mask`` = 1 on the tokens the assistant
produced), or pre-tokenized ``{"input_ids": [...], "loss_mask": [...]}``.

Every row is read and checked before any model weight is loaded: a bad row
stops the run with its line number and what to fix, before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from datagen.data.contract import SkippedRow, TruncatedRow
from datagen.errors import DatasetError, ModelError

log = logging.getLogger(__name__)

ROLES = frozenset({"system", "user", "assistant", "tool"})
TARGET_ROLE = "assistant"


@dataclass(frozen=True)
class Sample:
    """One tokenized row."""

    row: int  # 0-based line number in the dataset file
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


@dataclass
class PreparedDataset:
    """A whole dataset, read, checked and tokenized."""

    path: str
    rows: int  # number of lines (rows) in the file
    fingerprint: str  # sha256 of the file's bytes
    samples: dict[int, Sample]  # row -> sample, rows not skipped
    skipped: list[SkippedRow]
    truncated: list[TruncatedRow]
    line_hashes: list[bytes]  # sha256 digest of each row's raw bytes
    chat_template_hash: str | None  # sha256 of the chat template when chat rows exist
    tokenizer_hash: str | None  # tokenizer_fingerprint() when chat rows exist
    kinds: set[str] = field(default_factory=set)  # {"chat", "tokens"}
    # the tokens of every sample, when ``samples`` holds only some rows (a stored plan's shards)
    total_tokens: int | None = None

    def shard_rows_hash(self, first: int, count: int) -> str:
        """sha256 over the raw bytes' hashes of rows [first, first+count)."""
        h = hashlib.sha256()
        for d in self.line_hashes[first : first + count]:
            h.update(d)
        return h.hexdigest()

    @property
    def tokens(self) -> int:
        if self.total_tokens is not None:
            return self.total_tokens
        return sum(len(s.input_ids) for s in self.samples.values())


TokenizerLoader = Callable[[], object]


def read_rows(path: str | Path, *, digest=None) -> list[tuple[int, bytes, dict]]:
    """Parse each line of a JSONL file. Returns (row, raw bytes, object) per line.

    ``digest`` (a hashlib object), when given, is fed every byte read: the fingerprint of exactly
    the content parsed, even if the file changes while it is read.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(
            "dataset file does not exist" if not p.exists() else "dataset path is not a file",
            path=str(p),
            hint="pass a JSONL file with --dataset",
        )
    out = []
    with p.open("rb") as f:
        for i, raw in enumerate(f):
            line_no = i + 1
            if digest is not None:
                digest.update(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(
                    f"not valid UTF-8 (byte {e.start})", path=str(p), line=line_no,
                    hint="re-encode the file as UTF-8",
                ) from None
            if not text.strip():
                raise DatasetError(
                    "blank line", path=str(p), line=line_no,
                    hint="remove blank lines: every line must be one JSON object",
                )
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"malformed JSON ({e.msg} at column {e.colno})", path=str(p), line=line_no,
                    hint="each line must be one complete JSON object",
                ) from None
            if not isinstance(obj, dict):
                raise DatasetError(
                    f"a row must be a JSON object, got {type(obj).__name__}", path=str(p),
                    line=line_no, hint='write {"messages": [...]} or {"input_ids": [...]}',
                )
            out.append((i, raw.rstrip(b"\r\n"), obj))
    if not out:
        raise DatasetError("dataset is empty", path=str(p), hint="give at least one row")
    return out


def _check_tokens_row(obj: dict, *, path: str, line: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    unknown = set(obj) - {"input_ids", "loss_mask"}
    if unknown:
        raise DatasetError(
            f"unknown fields {sorted(unknown)} in a pre-tokenized row", path=path, line=line,
            hint="a pre-tokenized row has only input_ids and optionally loss_mask",
        )
    ids = obj["input_ids"]
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise DatasetError(
            "input_ids must be a list of integers", path=path, line=line,
            hint="write token ids as JSON integers",
        )
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise DatasetError(
            f"token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})",
            path=path, line=line, hint="tokenize with this model's tokenizer",
        )
    mask = obj.get("loss_mask")
    if mask is None:
        mask = [1] * len(ids)
    if not isinstance(mask, list) or not all(type(m) is int and m in (0, 1) for m in mask):
        raise DatasetError(
            "loss_mask must be a list of 0/1 integers", path=path, line=line,
            hint="or leave it out: it defaults to all 1",
        )
    if len(mask) != len(ids):
        raise DatasetError(
            f"loss_mask has {len(mask)} entries but input_ids has {len(ids)}", path=path,
            line=line, hint="give one mask value per token",
        )
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


# Optional message fields a chat template may render (tool calls, thinking blocks), by role.
OPTIONAL_FIELDS = {
    "assistant": {"reasoning_content", "tool_calls", "name"},
    "tool": {"tool_call_id", "name"},
    "user": {"name"},
    "system": {"name"},
}


def _check_messages(obj: dict, *, path: str, line: int) -> list[dict]:
    unknown = set(obj) - {"messages"}
    if unknown:
        raise DatasetError(
            f"unknown fields {sorted(unknown)} in a chat row", path=path, line=line,
            hint='a chat row is {"messages": [{"role": ..., "content": ...}, ...]}',
        )
    msgs = obj["messages"]
    if not isinstance(msgs, list):
        raise DatasetError("messages must be a list", path=path, line=line, hint="see README")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DatasetError(
                f"message {j} must be an object with exactly 'role' and 'content' (and its role's optional fields)",
                path=path, line=line, hint='e.g. {"role": "user", "content": "hi"}',
            )
        if not isinstance(m["role"], str) or m["role"] not in ROLES:
            raise DatasetError(
                f"message {j} has unknown role {m['role']!r}", path=path, line=line,
                hint=f"roles are {', '.join(sorted(ROLES))}",
            )
        extra = set(m) - {"role", "content"} - OPTIONAL_FIELDS[m["role"]]
        if extra:
            allowed = ", ".join(sorted(OPTIONAL_FIELDS[m["role"]]))
            raise DatasetError(
                f"message {j} ({m['role']}) has unknown fields {sorted(extra)}", path=path, line=line,
                hint=f"a {m['role']} message has role, content and optionally {allowed}",
            )
        if not isinstance(m["content"], str):
            raise DatasetError(
                f"message {j} content must be a string, got {type(m['content']).__name__}",
                path=path, line=line, hint="write the text of the message as a JSON string",
            )
        for key in ("reasoning_content", "tool_call_id", "name"):
            if key in m and not isinstance(m[key], str):
                raise DatasetError(f"message {j} {key} must be a string", path=path, line=line,
                                   hint=f"write {key} as a JSON string")
        if "tool_calls" in m and not _valid_tool_calls(m["tool_calls"]):
            raise DatasetError(
                f"message {j} tool_calls must be a list of {{id, type, function: {{name, arguments}}}}",
                path=path, line=line,
                hint='e.g. [{"id": "f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]',
            )
    return msgs


def _valid_tool_calls(calls) -> bool:
    if not isinstance(calls, list):
        return False
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(fn, dict) or not isinstance(c.get("id"), str) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments"), (str, dict))):
            return False
    return True


def target_spans(tokenizer, messages: list[dict], *, path: str = "", line: int = 0) -> tuple[str, list[tuple[int, int]]]:
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


def tokenize_chat(tokenizer, messages: list[dict], *, path: str = "", line: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and the assistant loss mask of one chat, with any tokenizer (slow or fast).

    The render is cut at the targets' boundaries and tokenized piece by piece; the pieces'
    tokens concatenated must equal the whole render's tokenization, which makes the mask exact
    (no token straddles a boundary). Chat templates put a special token or a newline at every
    turn boundary, where BPE does not merge; a tokenizer that merges across one anyway is read
    by character offsets when it is a fast tokenizer (a token is a target when its first
    character is), and refused otherwise.
    """
    full, spans = target_spans(tokenizer, messages, path=path, line=line)
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


def _tokenize_by_offsets(tokenizer, full: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        if e > s and any(a <= s < b for a, b in spans):
            mask[t] = 1
    return ids, mask


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides token ids: a fast tokenizer's serialized state, else the class,
    the vocabulary and the added tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and backend is not None:
        return hashlib.sha256(backend.to_str().encode()).hexdigest()
    added = {int(i): str(t) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    state = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items()),
             "added": sorted(added.items())}
    return hashlib.sha256(json.dumps(state, ensure_ascii=False).encode()).hexdigest()


def tokenizer_hashes(tokenizer) -> tuple[str, str]:
    """(sha256 of the chat template, ``tokenizer_fingerprint``): what a plan records of a tokenizer."""
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(), tokenizer_fingerprint(tokenizer)


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a dataset file as it is now (``PreparedDataset.fingerprint`` is this at read time)."""
    from datagen.data.checksums import sha256_file

    return sha256_file(path)


def prepare_dataset(
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
    for row, _raw, obj in rows:
        line = row + 1
        if "messages" in obj:
            msgs = _check_messages(obj, path=str(p), line=line)
            kinds.add("chat")
            if not msgs:
                skipped.append(SkippedRow(row=row, reason="empty"))
                continue
            if tokenizer is None:
                tokenizer = load_tokenizer()
            ids, mask = tokenize_chat(tokenizer, msgs, path=str(p), line=line)
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
        line_hashes=[hashlib.sha256(raw).digest() for _, raw, _ in rows],
        chat_template_hash=template_hash,
        tokenizer_hash=tok_hash,
        kinds=kinds,
    )
