"""Reading a JSONL dataset into token ids and loss masks.

A row is either a chat ``{"messages": [{"role", "content"}, ...]}``, tokenized
with the model's chat template (``loss_mask`` = 1 on the tokens the assistant
produced), or pre-tokenized ``{"input_ids": [...], "loss_mask": [...]}``. A user
message's content may be a list of text and image parts (``datagen.data.media``).

Every row is read and checked before any model weight is loaded: a bad row
stops the run with its line number and what to fix, before anything is written.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from datagen.data.contract import SkippedRow, TruncatedRow
from datagen.errors import DatasetError, ModelError
from datagen.data.tiktoken_ids import tiktoken_encoder

log = logging.getLogger(__name__)

ROLES = frozenset({"system", "user", "assistant", "tool"})
TARGET_ROLE = "assistant"


@dataclass(frozen=True)
class Sample:
    """One tokenized row."""

    row: int  # 0-based line number in the dataset file
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    media: tuple = ()  # datagen.data.media.MediaItem per image of the row, in token order


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


def check_file(path: str | Path) -> Path:
    """The dataset path as a file, or the error that says what it is instead."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(
            "dataset file does not exist" if not p.exists() else "dataset path is not a file",
            path=str(p),
            hint="pass a JSONL file with --dataset",
        )
    return p


def parse_row(raw: bytes, *, path: str, line: int) -> dict:
    """One line of a JSONL file (with its line end, as read) as a JSON object, or the error that
    names what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"not valid UTF-8 (byte {e.start})", path=path, line=line,
            hint="re-encode the file as UTF-8",
        ) from None
    if not text.strip():
        raise DatasetError(
            "blank line", path=path, line=line,
            hint="remove blank lines: every line must be one JSON object",
        )
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(
            f"malformed JSON ({e.msg} at column {e.colno})", path=path, line=line,
            hint="each line must be one complete JSON object",
        ) from None
    if not isinstance(obj, dict):
        raise DatasetError(
            f"a row must be a JSON object, got {type(obj).__name__}", path=path,
            line=line, hint='write {"messages": [...]} or {"input_ids": [...]}',
        )
    return obj


def empty_dataset(path: str | Path) -> DatasetError:
    return DatasetError("dataset is empty", path=str(path), hint="give at least one row")


def read_rows(path: str | Path, *, digest=None) -> list[tuple[int, bytes, dict]]:
    """Parse each line of a JSONL file. Returns (row, raw bytes, object) per line.

    ``digest`` (a hashlib object), when given, is fed every byte read: the fingerprint of exactly
    the content parsed, even if the file changes while it is read. (Planning reads the lines in
    its worker processes instead: ``datagen.data.planning``.)
    """
    p = check_file(path)
    out = []
    with p.open("rb") as f:
        for i, raw in enumerate(f):
            if digest is not None:
                digest.update(raw)
            out.append((i, raw.rstrip(b"\r\n"), parse_row(raw, path=str(p), line=i + 1)))
    if not out:
        raise empty_dataset(p)
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
        if isinstance(m["content"], list):
            from datagen.data import media

            media.check_parts(m["content"], j=j, role=m["role"], path=path, line=line)
        elif not isinstance(m["content"], str):
            raise DatasetError(
                f"message {j} content must be a string, got {type(m['content']).__name__}",
                path=path, line=line,
                hint="write the text of the message as a JSON string (or a user message as a list of text and image_url parts)",
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
    template writes after the prompt). A chat that opens with the assistant has the render of an
    empty conversation as its first prompt (``render_prompt``); a template that cannot render a
    prefix refuses the row with its reason (``template_error``). Both renders must be prefixes of
    the whole chat's. The
    renders of a row are asked for in two calls (prompts, then the whole chat and the turns'
    ends; a chat ending on its last target turn is that turn's end), as a list of conversations:
    the same renders, without the per-call work of ``apply_chat_template``.
    """
    targets = [i for i, m in enumerate(messages) if m["role"] == TARGET_ROLE]
    try:
        full, starts, ends = _renders(tokenizer, messages, targets)
    except Exception:  # noqa: BLE001 - a template that raises: raise as the renders one by one do
        full, starts, ends = _renders_one_by_one(tokenizer, messages, targets, path=path, line=line)
    spans: list[tuple[int, int]] = []
    for i, start_text, end_text in zip(targets, starts, ends):
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


def _render(tokenizer, conversation, gen: bool):
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=gen)


def render_prompt(tokenizer, conversation: list[dict]) -> str:
    """The conversation so far with the generation prompt. An empty conversation (the prompt of a
    chat that opens with the assistant) is rendered as a batch of one: transformers refuses an
    empty conversation on its own, but renders it in a batch like any other, so the template
    decides what the render of nothing is (its generation prompt, a BOS, or an error of its own)."""
    if not conversation:
        return _render(tokenizer, [[]], True)[0]
    return _render(tokenizer, conversation, True)


def template_error(e: Exception, *, what: str, path: str, line: int | None) -> DatasetError:
    """A chat template (or tokenizer) that raised, as the row's error: the line, what was being
    rendered, and the template's own reason."""
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return DatasetError(
        f"the chat template cannot render {what}: {type(e).__name__}: {reason}", path=path, line=line,
        hint="fix the chat (the template's reason says what it expects), or pre-tokenize this row with "
             "input_ids and loss_mask",
    )


def _renders_one_by_one(tokenizer, messages, targets, *, path: str = "", line: int = 0) -> tuple[str, list[str], list[str]]:
    def attempt(what: str, render):
        try:
            return render()
        except Exception as e:  # noqa: BLE001 - any template error is the row's error
            raise template_error(e, what=what, path=path, line=line) from e

    full = attempt("the chat", lambda: _render(tokenizer, messages, False))
    starts, ends = [], []
    for i in targets:
        starts.append(attempt(f"the prompt of assistant message {i}" + (" (an empty conversation)" if i == 0 else ""),
                              lambda: render_prompt(tokenizer, messages[:i])))
        ends.append(attempt(f"the chat up to message {i}", lambda: _render(tokenizer, messages[: i + 1], False)))
    return full, starts, ends


def _renders(tokenizer, messages, targets) -> tuple[str, list[str], list[str]]:
    if not targets:
        return _renders_one_by_one(tokenizer, messages, targets)
    last = len(messages) - 1
    whole_and_ends = _render(tokenizer, [messages, *(messages[: i + 1] for i in targets if i != last)], False)
    full = whole_and_ends[0]
    ends = list(whole_and_ends[1:]) + ([full] if targets[-1] == last else [])
    # (a batch of conversations: an empty one, the prompt of an opening assistant turn, renders too)
    return full, list(_render(tokenizer, [messages[:i] for i in targets], True)), ends


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _ids_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    """``_ids`` of each text, in one call (a batch: the same ids as one call per text)."""
    nonempty = [t for t in texts if t]
    if not nonempty:
        got = iter([])
    elif (backend := _plain_backend(tokenizer)) is not None:
        got = (e.ids for e in backend.encode_batch_fast(nonempty, add_special_tokens=False))
    elif (encode := tiktoken_encoder(tokenizer)) is not None:  # the slow Kimi tokenizer's ids from tiktoken
        got = iter(encode(nonempty))
    else:
        got = iter(tokenizer(nonempty, add_special_tokens=False)["input_ids"])
    return [list(next(got)) if t else [] for t in texts]


def _plain_backend(tokenizer):
    """The Rust tokenizer of a fast tokenizer whose call adds nothing to it here: transformers'
    own encode path (not a subclass's), no truncation or padding to switch off, special tokens
    split out. Its ``encode_batch_fast`` then gives the call's ids without computing offsets."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    cls = type(tokenizer)
    if (backend is None or cls.__call__ is not TokenizersBackend.__call__
            or cls._encode_plus is not TokenizersBackend._encode_plus or not hasattr(backend, "encode_batch_fast")):
        return None
    if backend.truncation is not None or backend.padding is not None or getattr(tokenizer, "split_special_tokens", False):
        return None
    return backend if backend.encode_special_tokens is False else None


class Boundaries(enum.Enum):
    """How ``tokenize_chat`` knows that no token straddles a turn boundary."""

    # tokenize the whole render too and compare it with the pieces' tokens (always right)
    COMPARE_WHOLE = "compare_whole"
    # a cut next to an added token that the tokenizer splits out before anything else (Kimi's
    # <|im_middle|> before a target, <|im_end|> after it) needs no comparison: the text on either
    # side is tokenized apart in the whole render too; other cuts are compared as above
    TRUST_SPECIAL_TOKENS = "trust_special_tokens"


# Text on either side of an added token in the probes of ``SplitTokens``: words, spaces,
# newlines, digits, punctuation, Han, and another added token right beside it.
_PROBE_SIDES = (("Hello world", "again here"), ("x", "y"), ("  ", "\n\n"), ("中文", "测试"), ("12", "34"), ("!!", "?!"),
                ("", " a"), ("a ", ""))


class SplitTokens:
    """The added tokens that a tokenizer splits out of a text before tokenizing the rest, so that
    a cut next to one needs no comparison with the whole render: no stripping of neighbours, no
    whole-word rule, matched on the raw text, and checked on probes the first time one sits at a
    cut (the text before it, it and the text after it, tokenized apart, give the tokens of the
    three together). None when the tokenizer is told to tokenize special tokens as text."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._tokens = set() if getattr(tokenizer, "split_special_tokens", False) else {
            t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
            if getattr(t, "content", None) and not getattr(t, "lstrip", False) and not getattr(t, "rstrip", False)
            and not getattr(t, "single_word", False) and not getattr(t, "normalized", False)
        }
        self._lengths = sorted({len(t) for t in self._tokens}, reverse=True)
        self._checked: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def _splits(self, token: str) -> bool:
        if token not in self._checked:
            others = sorted(self._tokens - {token})[:1] or [""]
            sides = [*_PROBE_SIDES, (others[0], others[0])]
            texts = [x for a, b in sides for x in (a, token, b, a + token + b)]
            ids = _ids_batch(self._tokenizer, texts)
            self._checked[token] = all(ids[4 * j] + ids[4 * j + 1] + ids[4 * j + 2] == ids[4 * j + 3]
                                       for j in range(len(sides)))
        return self._checked[token]

    def at(self, text: str, c: int) -> bool:
        """Whether position ``c`` of ``text`` is the start or end of a token checked to split."""
        if c in (0, len(text)):
            return True
        for n in self._lengths:
            for t in (text[c - n : c] if c >= n else "", text[c : c + n]):
                if len(t) == n and t in self._tokens and self._splits(t):
                    return True
        return False


def tokenize_chat(tokenizer, messages: list[dict], *, path: str = "", line: int = 0,
                  boundaries: Boundaries = Boundaries.COMPARE_WHOLE,
                  split_tokens: SplitTokens | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and the assistant loss mask of one chat, with any tokenizer (slow or fast).

    The render is cut at the targets' boundaries and tokenized piece by piece; the pieces'
    tokens concatenated must equal the whole render's tokenization, which makes the mask exact
    (no token straddles a boundary). Chat templates put a special token or a newline at every
    turn boundary, where BPE does not merge; a tokenizer that merges across one anyway is read
    by character offsets when it is a fast tokenizer (a token is a target when its first
    character is), and refused otherwise. With ``Boundaries.TRUST_SPECIAL_TOKENS`` and every cut
    next to one of ``split_tokens`` (``SplitTokens(tokenizer)``), the whole render is not
    tokenized a second time: its tokens are the pieces'.
    """
    (got,) = tokenize_chats(tokenizer, [(messages, line)], path=path, boundaries=boundaries, split_tokens=split_tokens)
    if isinstance(got, Exception):
        raise got
    return got


def tokenize_chats(tokenizer, chats: list[tuple[list[dict], int]], *, path: str = "",
                   boundaries: Boundaries = Boundaries.COMPARE_WHOLE,
                   split_tokens: SplitTokens | None = None) -> list[tuple[np.ndarray, np.ndarray] | Exception]:
    """``tokenize_chat`` of each (messages, line), the tokenizer called once for all of them (a
    call per chat costs more than its tokens with a fast tokenizer). A chat that fails gives its
    exception in its place, and the list ends there."""
    rendered, texts, failed = [], [], None
    for messages, line in chats:
        try:
            full, spans = target_spans(tokenizer, messages, path=path, line=line)
        except Exception as e:  # noqa: BLE001 - handed back in its chat's place
            failed = e
            break
        cuts = sorted({0, len(full), *(c for span in spans for c in span)})
        trusted = (boundaries is Boundaries.TRUST_SPECIAL_TOKENS and split_tokens is not None
                   and all(split_tokens.at(full, c) for c in cuts))
        pieces = [full[a:b] for a, b in zip(cuts, cuts[1:])]
        texts += pieces if trusted else [*pieces, full]
        rendered.append((full, spans, cuts, trusted, line))
    counts = [len(cuts) - 1 + (0 if trusted else 1) for _, _, cuts, trusted, _ in rendered]
    try:
        encoded = _ids_batch(tokenizer, texts)
    except Exception:  # noqa: BLE001 - a tokenizer that raises: find the chat it raises for
        encoded = None
    out: list = []
    at = 0
    for (full, spans, cuts, trusted, line), n in zip(rendered, counts):
        try:
            pieces = encoded[at : at + n] if encoded is not None else _tokenized(tokenizer, texts[at : at + n],
                                                                                   path=path, line=line)
            out.append(_masked(tokenizer, full, spans, cuts, pieces, trusted, path=path, line=line))
        except DatasetError as e:
            out.append(e)
            return out
        except Exception as e:  # noqa: BLE001 - the tokenizer's own error, as this row's
            out.append(_tokenizer_error(e, path=path, line=line))
            return out
        at += n
    return out + ([failed] if failed is not None else [])


def _tokenized(tokenizer, texts: list[str], *, path: str, line: int) -> list[list[int]]:
    try:
        return _ids_batch(tokenizer, texts)
    except Exception as e:  # noqa: BLE001 - the tokenizer's own error, as this row's
        raise _tokenizer_error(e, path=path, line=line) from e


def _tokenizer_error(e: Exception, *, path: str, line: int) -> DatasetError:
    error = DatasetError(f"the tokenizer cannot tokenize the chat's render: {type(e).__name__}: {e}",
                         path=path, line=line, hint="pre-tokenize this row with input_ids and loss_mask")
    error.__cause__ = e
    return error


def _masked(tokenizer, full: str, spans, cuts, encoded: list[list[int]], trusted: bool, *, path: str,
            line: int) -> tuple[np.ndarray, np.ndarray]:
    ids: list[int] = []
    mask: list[int] = []
    for (a, b), piece in zip(zip(cuts, cuts[1:]), encoded):
        target = any(s <= a and b <= e for s, e in spans)
        ids.extend(piece)
        mask.extend([int(target)] * len(piece))
    whole = ids if trusted else encoded[-1]
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
