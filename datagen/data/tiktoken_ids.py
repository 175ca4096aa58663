"""The ids of the project's slow Kimi tokenizer, from tiktoken in one call per text.

``tokenizer(text, add_special_tokens=False)`` of a slow tiktoken tokenizer (``tokenization_kimi.py``,
the project's own, ``datagen/models/_tokenization_kimi.py``) goes through transformers' Python path:
an added-token trie, tiktoken's ids turned into token strings and back, a dict lookup per token.
``tiktoken_encoder`` gives the same ids from ``Encoding.encode`` directly, and only where that is
the same computation (see its checks); any other tokenizer gets None and keeps its own call.
"""

from __future__ import annotations

import weakref

# tokenizer -> (the state it was checked in, encode or None)
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Texts on which the shortcut must give the tokenizer's own ids before it is used.
_PROBES = ("Hello world, it's 12345 tokens!", "中文分词 测试", "  \n\n\t x=1+2 🎉", "don't HTTPServer's")


# The two methods of the project's slow tokenizer that the shortcut stands for, as written there
# (a class is accepted when its methods compile to the same code).
def _tokenize(self, text, **kwargs):
    return [self.decoder[t] for t in self.model.encode(text, disallowed_special=())]


def _convert_token_to_id(self, token):
    return self.encoder.get(token, self.special_tokens.get(str(self.unk_token)))


def _same_code(a, b) -> bool:
    a, b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return a is not None and b is not None and _code(a) == _code(b)


def _code(c):
    """What a code object computes (not where it was written: nested code compared the same way)."""
    return (c.co_code, c.co_names, c.co_varnames,
            tuple(_code(k) if hasattr(k, "co_code") else k for k in c.co_consts))


def tiktoken_encoder(tokenizer):
    """A function from texts to the ids ``tokenizer(text, add_special_tokens=False)`` gives each, by
    tiktoken alone, or None. Taken only when: the tokenizer is a slow tokenizer over a
    ``tiktoken.Encoding`` whose tokenization is the project's own (the same code), transformers'
    tokenize path is not overridden, its added tokens are exactly the tiktoken special tokens it
    allows, with the same ids, none strips its neighbours or is a prefix of another, every base
    token's string maps back to its id, and probe texts give the same ids. Checked once per
    tokenizer (again when its added tokens change)."""
    try:
        weakref.ref(tokenizer)
    except TypeError:
        return None
    state = _state(tokenizer)
    if tokenizer not in _CHECKED or _CHECKED[tokenizer][0] != state:
        _CHECKED[tokenizer] = (state, _build(tokenizer))
    return _CHECKED[tokenizer][1]


def _state(tokenizer) -> tuple:
    added = getattr(tokenizer, "_added_tokens_decoder", None) or {}
    return (type(tokenizer), getattr(tokenizer, "split_special_tokens", False), id(getattr(tokenizer, "model", None)),
            tuple((i, str(t), *(getattr(t, k, None) for k in ("lstrip", "rstrip", "single_word", "normalized")))
                  for i, t in sorted(added.items())))


def _build(tokenizer):
    try:
        import tiktoken
        from transformers.tokenization_python import PythonBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    model = getattr(tokenizer, "model", None)
    if not isinstance(model, tiktoken.Encoding) or not isinstance(tokenizer, PythonBackend):
        return None
    if getattr(tokenizer, "split_special_tokens", False):
        return None
    if not (_same_code(getattr(cls, "_tokenize", None), _tokenize)
            and _same_code(getattr(cls, "_convert_token_to_id", None), _convert_token_to_id)):
        return None
    inherited = ("tokenize", "prepare_for_tokenization", "_encode_plus", "__call__", "convert_tokens_to_ids",
                 "_convert_token_to_id_with_added_voc")
    if any(getattr(cls, n, None) is not getattr(PythonBackend, n, None) for n in inherited):
        return None
    added = tokenizer._added_tokens_encoder
    if any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) or getattr(t, "single_word", False)
           or (getattr(t, "normalized", False) and getattr(tokenizer, "do_lower_case", False))
           for t in tokenizer._added_tokens_decoder.values()):
        return None
    specials = dict(getattr(tokenizer, "special_tokens", None) or {})
    if any(specials.get(s) != i for s, i in added.items()) or set(tokenizer.all_special_tokens) - set(added):
        return None
    names = sorted(added)
    if any(b.startswith(a) for a, b in zip(names, names[1:])):  # sorted: a prefix sits right before
        return None
    encoder, decoder = getattr(tokenizer, "encoder", {}), getattr(tokenizer, "decoder", {})
    if any(encoder.get(decoder.get(t)) != t or decoder.get(t) in added for t in range(model.n_vocab - len(specials))):
        return None
    allowed = frozenset(added)

    def encode(texts: list[str]) -> list[list[int]]:
        return [model.encode(t, allowed_special=allowed, disallowed_special=()) for t in texts]

    probes = [*_PROBES, *(f"a{s}b {s}\n{s}{s}" for s in names[:8])]
    if encode(probes) != [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in probes]:
        return None
    return encode
