"""Loading the tokenizer that turns chat rows into tokens: the model's own, or one the spec names.

A model may ship its tokenizer as code (``auto_map`` in tokenizer_config.json, loaded with
``trust_remote_code``). When that code cannot run under the installed transformers (Kimi's
released ``tokenization_kimi.py`` imports ``bytes_to_unicode`` from
``transformers.models.gpt2.tokenization_gpt2``, which transformers 5 removed), the error says so
and names the way on: a tokenizer named in the spec (for Kimi, the fast tokenizer
``python -m datagen.models.kimi_tokenizer`` converts once from the model's own ranks and checks
id for id against the slow one).
"""

from __future__ import annotations

import json
import traceback
import weakref
from pathlib import Path

from datagen.errors import ModelError
from datagen.models.modelinfo import has_tokenizer_files

CONFIG_FILE = "tokenizer_config.json"


def shipped_code_files(d: Path) -> set[str]:
    """The Python files a tokenizer directory's ``auto_map`` names (``module.Class`` -> module.py)."""
    try:
        auto = json.loads((d / CONFIG_FILE).read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return set()
    names = []
    for v in auto.values() if isinstance(auto, dict) else []:
        names += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, str)]
    return {n.split("--")[-1].rsplit(".", 1)[0] + ".py" for n in names}


def _failed_in_shipped_code(e: BaseException, files: set[str]) -> str | None:
    """The shipped file (of ``files``) in whose import or run ``e`` was raised, or None."""
    for frame in traceback.extract_tb(e.__traceback__):
        p = Path(frame.filename)
        if p.name in files and "transformers_modules" in p.parts:
            return p.name
    return None


def _fix_hint(d: Path) -> str:
    if (d / "tiktoken.model").is_file():
        return (f"convert it once to a fast tokenizer checked against these ranks: "
                f"python -m datagen.models.kimi_tokenizer {d} TOKENIZER_DIR, then set \"tokenizer\": "
                f"\"TOKENIZER_DIR\" in the spec (or pre-tokenize the dataset)")
    return ("name a tokenizer that runs under the installed transformers in the spec's \"tokenizer\" "
            "(a directory with tokenizer.json), or pre-tokenize the dataset")


def load_tokenizer(model: str | Path, *, tokenizer: str | Path | None = None, trust_remote_code: bool = False):
    """The tokenizer for a model's chat rows: ``tokenizer`` when given, else the model's own.

    Args:
        model: the model directory.
        tokenizer: a tokenizer directory named by the spec, used instead of the model's.
        trust_remote_code: whether the model's own tokenizer code may run (the spec's engine setting).

    Raises:
        ModelError: no tokenizer files, shipped code that cannot run under the installed
            transformers, a tokenizer transformers cannot load, or no chat template.
    """
    import transformers
    from transformers import AutoTokenizer

    d = Path(tokenizer if tokenizer is not None else model)
    whose = f"tokenizer {d} named in the spec" if tokenizer is not None else f"the tokenizer of {model}"
    if not d.is_dir() or not has_tokenizer_files(d):
        raise ModelError(
            f"the dataset has chat rows but {whose} has no tokenizer files",
            hint="name a tokenizer directory in the spec's \"tokenizer\"" if tokenizer is not None else
                 "add the tokenizer files to the model directory, name a tokenizer in the spec, or pre-tokenize the dataset",
        )
    files = shipped_code_files(d)
    try:  # slow or fast; shipped code (Kimi's tokenization_kimi.py) only when the spec allows it
        tok = AutoTokenizer.from_pretrained(d, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - the shipped code may raise anything; each case says what to do
        shipped = _failed_in_shipped_code(e, files) if trust_remote_code else None
        if shipped is not None:
            raise ModelError(
                f"{whose} is shipped as code ({shipped}) that cannot run under the installed transformers "
                f"{transformers.__version__}: {type(e).__name__}: {e}",
                hint=_fix_hint(d),
            ) from e
        if files and not trust_remote_code and isinstance(e, (OSError, ValueError)):
            raise ModelError(f"{whose} is shipped as code ({', '.join(sorted(files))}) and the spec does not allow it to run",
                             hint="set engine.trust_remote_code=true for a model source you trust, or name a "
                                  "tokenizer in the spec") from e
        if not isinstance(e, (OSError, ValueError, ImportError)):
            raise
        raise ModelError(f"transformers cannot load {whose}: {e}",
                         hint="name a tokenizer that loads in the spec's \"tokenizer\", or pre-tokenize the dataset") from e
    if not getattr(tok, "chat_template", None):
        raise ModelError(f"{whose} has no chat template",
                         hint="add chat_template.jinja (or chat_template in tokenizer_config.json), or pre-tokenize the dataset")
    return tok


# --- the slow tiktoken tokenizer's ids, from tiktoken in one step --------------------------------

_TIKTOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its state, encode or None)
# Texts on which the shortcut must give the slow tokenizer's ids before it is used.
_PROBES = ("Hello world, it's 12345 tokens!", "中文分词 测试", "  \n\n\t x=1+2 🎉", "don't HTTPServer's")


def _same_code(a, b) -> bool:
    a, b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return a is not None and b is not None and (a.co_code, a.co_names, a.co_consts) == (b.co_code, b.co_names, b.co_consts)


def tiktoken_encoder(tokenizer):
    """For the project's slow Kimi tokenizer (``tokenization_kimi.py`` over a ``tiktoken.Encoding``):
    a function from texts to the ids that ``tokenizer(text, add_special_tokens=False)`` gives each,
    computed by tiktoken in one call per text (no Python pass over token strings). None for any
    other tokenizer, and whenever the shortcut cannot be shown to give the same ids: the class's
    tokenization is the project's own (the same code), its added tokens are exactly tiktoken's
    special tokens it allows, with the same ids, none stripping its neighbours, none a prefix of
    another, every base token's string maps back to its id, and probe texts agree."""
    if not _weakrefable(tokenizer):
        return None
    state = _added_state(tokenizer)  # a tokenizer changed since (tokens added) is checked again
    if tokenizer not in _TIKTOKEN or _TIKTOKEN[tokenizer][0] != state:
        _TIKTOKEN[tokenizer] = (state, _build_tiktoken_encoder(tokenizer))
    return _TIKTOKEN[tokenizer][1]


def _added_state(tokenizer) -> tuple:
    added = getattr(tokenizer, "_added_tokens_decoder", None) or {}
    return (type(tokenizer), getattr(tokenizer, "split_special_tokens", False), getattr(tokenizer, "model", None),
            tuple((i, str(t), *(getattr(t, k, None) for k in ("lstrip", "rstrip", "single_word", "normalized")))
                  for i, t in sorted(added.items())))


def _weakrefable(obj) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _build_tiktoken_encoder(tokenizer):
    try:
        import tiktoken
        from transformers.tokenization_python import PythonBackend

        from datagen.models._tokenization_kimi import TikTokenTokenizer
    except ImportError:
        return None
    cls = type(tokenizer)
    model = getattr(tokenizer, "model", None)
    if not isinstance(model, tiktoken.Encoding) or getattr(tokenizer, "split_special_tokens", False):
        return None
    ours = ("_tokenize", "_convert_token_to_id", "__init__")
    if not all(_same_code(getattr(cls, n, None), getattr(TikTokenTokenizer, n)) for n in ours):
        return None
    inherited = ("tokenize", "prepare_for_tokenization", "_encode_plus", "__call__", "convert_tokens_to_ids",
                 "_convert_token_to_id_with_added_voc")
    if any(getattr(cls, n, None) is not getattr(PythonBackend, n, None) for n in inherited):
        return None
    added = tokenizer._added_tokens_encoder
    decoder = tokenizer._added_tokens_decoder
    if any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) or getattr(t, "single_word", False)
           or (getattr(t, "normalized", False) and getattr(tokenizer, "do_lower_case", False)) for t in decoder.values()):
        return None
    specials = dict(tokenizer.special_tokens)
    if any(specials.get(s) != i for s, i in added.items()) or set(tokenizer.all_special_tokens) - set(added):
        return None
    names = sorted(added)
    if any(b.startswith(a) for a, b in zip(names, names[1:])):  # sorted: a prefix sits right before
        return None
    base = model.n_vocab - len(specials)
    if any(tokenizer.encoder.get(tokenizer.decoder.get(t)) != t or tokenizer.decoder.get(t) in added
           for t in range(base)):
        return None
    allowed = frozenset(added)

    def encode(texts: list[str]) -> list[list[int]]:
        return [model.encode(t, allowed_special=allowed, disallowed_special=()) for t in texts]

    probes = [*_PROBES, *(f"a{s}b {s}\n{s}{s}" for s in names[:8])]
    if encode(probes) != [tokenizer(p, add_special_tokens=False)["input_ids"] for p in probes]:
        return None
    return encode
