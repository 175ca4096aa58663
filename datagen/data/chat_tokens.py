"""A chat's render tokenized into ids and the assistant loss mask, with any tokenizer (slow or fast).

``tokenize_chats`` cuts each render (``datagen.data.chat_template.target_spans``) at its targets'
boundaries, tokenizes the pieces of every chat in one call, and checks that no token straddles a
boundary (``Boundaries``, ``SplitTokens``); a fast tokenizer that merges across one is read by
character offsets instead.
"""

from __future__ import annotations

import enum

import numpy as np

from datagen.data.chat_template import target_spans
from datagen.data.tiktoken_ids import tiktoken_encoder
from datagen.errors import DatasetError


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


def tokenize_chat(tokenizer, messages: list[dict], *, tools: list[dict] | None = None, path: str = "", line: int = 0,
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
    tokenized a second time: its tokens are the pieces'. ``tools`` are the row's tool declarations,
    rendered by the template where it renders them (never a target).
    """
    (got,) = tokenize_chats(tokenizer, [(messages, line, tools)], path=path, boundaries=boundaries,
                            split_tokens=split_tokens)
    if isinstance(got, Exception):
        raise got
    return got


def tokenize_chats(tokenizer, chats: list[tuple[list[dict], int, list[dict] | None]], *, path: str = "",
                   boundaries: Boundaries = Boundaries.COMPARE_WHOLE,
                   split_tokens: SplitTokens | None = None) -> list[tuple[np.ndarray, np.ndarray] | Exception]:
    """``tokenize_chat`` of each (messages, line, tools), the tokenizer called once for all of them (a
    call per chat costs more than its tokens with a fast tokenizer). A chat that fails gives its
    exception in its place, and the list ends there."""
    rendered, texts, failed = [], [], None
    for messages, line, tools in chats:
        try:
            full, spans = target_spans(tokenizer, messages, tools=tools, path=path, line=line)
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
