"""Kimi's tokenizer: its real files beside the project's own slow tokenizer code, and a fast
``tokenizer.json`` converted once from its tiktoken ranks.

Kimi-K2, K2-Thinking and K2.5 ship ``tiktoken.model`` (163,584 ranks), ``tokenizer_config.json``
(256 reserved special ids after the ranks) and ``tokenization_kimi.py``, a slow tokenizer loaded as
remote code. The released ``tokenization_kimi.py`` imports ``bytes_to_unicode`` from
``transformers.models.gpt2.tokenization_gpt2``, which transformers 5 no longer has, so it cannot run
under the installed transformers; and a slow tokenizer gives no character offsets and tokenizes
in Python. The supported way on is a fast tokenizer converted from the same ranks by transformers'
own ``TikTokenConverter`` (Kimi's pre-tokenization pattern, every reserved id in place) and checked
id for id against the slow tokenizer on a corpus before it is written::

    python -m datagen.models.kimi_tokenizer MODEL_DIR OUT_DIR [--corpus FILE.jsonl]

then name ``OUT_DIR`` as the spec's ``tokenizer``. The fingerprint of a plan records the
tokenizer that ran (the fast tokenizer's serialized state), as for any tokenizer.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from datagen.models import _tokenization_kimi as kimi_code

log = logging.getLogger(__name__)

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
CODE_FILE = "tokenization_kimi.py"
TEMPLATE_FILE = "chat_template.jinja"


class ConversionMismatch(ValueError):
    """The converted fast tokenizer gives other ids than the slow one on a text."""

    def __init__(self, text: str, slow: list[int], fast: list[int]):
        self.text, self.slow, self.fast = text, slow, fast
        k = next((i for i, (a, b) in enumerate(zip(slow, fast)) if a != b), min(len(slow), len(fast)))
        super().__init__(f"the converted tokenizer differs from the slow one at token {k} of {text[:80]!r}: "
                         f"slow {slow[k:k + 4]}, fast {fast[k:k + 4]}")


def write_slow_tokenizer(src: str | Path, out: str | Path, *, chat_template: str | None = None) -> Path:
    """A loadable slow Kimi tokenizer in ``out``: ``src``'s ranks and tokenizer_config.json, the
    project's ``tokenization_kimi.py`` (the released one cannot run under transformers 5), and
    ``chat_template`` when given (else the config's own). Load it with ``trust_remote_code``."""
    s, d = Path(src), Path(out)
    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(s / RANKS_FILE, d / RANKS_FILE)
    shutil.copyfile(s / CONFIG_FILE, d / CONFIG_FILE)
    shutil.copyfile(kimi_code.__file__, d / CODE_FILE)
    if chat_template is not None:
        (d / TEMPLATE_FILE).write_text(chat_template)
    return d


def _special_tokens(config: dict, base: int) -> list[tuple[int, str, bool]]:
    """(id, content, special) of every reserved id, as the slow tokenizer names them."""
    named = {int(i): t for i, t in (config.get("added_tokens_decoder") or {}).items()}
    return [(i, named[i]["content"] if i in named else f"<|reserved_token_{i}|>", bool(named.get(i, {}).get("special", True)))
            for i in range(base, base + kimi_code.NUM_RESERVED_SPECIAL_TOKENS)]


def convert(src: str | Path):
    """A ``PreTrainedTokenizerFast`` of the Kimi tokenizer in ``src`` (``tiktoken.model`` and
    ``tokenizer_config.json``; the chat template of ``chat_template.jinja`` or the config).

    Raises:
        FileNotFoundError: ``src`` lacks the ranks or the config.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    s = Path(src)
    for name in (RANKS_FILE, CONFIG_FILE):
        if not (s / name).is_file():
            raise FileNotFoundError(f"{s} has no {name}: it is not a Kimi tokenizer directory")
    config = json.loads((s / CONFIG_FILE).read_text())
    backend = TikTokenConverter(vocab_file=str(s / RANKS_FILE), pattern=kimi_code.PAT_STR).converted()
    base = backend.get_vocab_size(with_added_tokens=False)
    specials = _special_tokens(config, base)
    # added one by one, in id order: each takes the next id, so the reserved ids stay where Kimi has them
    for i, content, special in specials:
        backend.add_tokens([AddedToken(content, normalized=False, special=special)])
        if backend.token_to_id(content) != i:
            raise ValueError(f"special token {content!r} landed at id {backend.token_to_id(content)}, not {i}")
    template = (s / TEMPLATE_FILE).read_text() if (s / TEMPLATE_FILE).is_file() else config.get("chat_template")
    names = {k: config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    extra = [c for _, c, special in specials if special and c not in names.values() and not c.startswith("<|reserved_token_")]
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, clean_up_tokenization_spaces=False,
                                   model_max_length=config.get("model_max_length", 1 << 20),
                                   additional_special_tokens=extra, **names)


def check_same_ids(slow, fast, texts: Iterable[str]) -> int:
    """Every text tokenized by both (``add_special_tokens=False``, special tokens in the text
    included); returns the number of tokens compared.

    Raises:
        ConversionMismatch: on the first text whose ids differ.
    """
    n = 0
    for text in texts:
        a = list(slow(text, add_special_tokens=False)["input_ids"])
        b = list(fast(text, add_special_tokens=False)["input_ids"])
        if a != b:
            raise ConversionMismatch(text, a, b)
        n += len(a)
    return n


def check_corpus(slow) -> list[str]:
    """Texts that exercise what Kimi's pattern splits: cased words and contractions, Han runs,
    digits, punctuation runs with newlines, whitespace runs, other scripts, emoji, every named
    special token between words, and the chat template's renders of a few chats."""
    texts = [
        "Hello, world! It's a test: don't we'll they've I'm you'd.", "HTTPServer parses JSONValue and XMLHttpRequest",
        "中文分词测试，这是一个句子。混合English和中文123。", "日本語のテキストとカタカナ、ひらがな", "한국어 문장입니다",
        "numbers 1 12 123 1234 12345 3.14159 -42 1e10 0x1F", "  leading   spaces\tand\ttabs   \n\n\n  trailing  ",
        "punctuation!!! ??? ... --- *** ((())) [[]] {{}} <<>>\n\n", "line one\r\nline two\rline three\n",
        "emoji 😀🎉👍🏽 and symbols ∑∫√∞ ≠ ≤ ≥ and accents café naïve Ångström", "Ελληνικά Русский العربية עברית हिन्दी ไทย",
        "def f(x):\n    return x**2  # a comment\n\nprint(f(3))\n", '{"key": "value", "list": [1, 2, 3]}',
    ]
    texts += [f"before{tok}after {tok} spaced" for tok in slow.all_special_tokens]
    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Why is the sky blue?"},
            {"role": "assistant", "content": "Rayleigh scattering: shorter wavelengths scatter more."},
            {"role": "user", "content": "和日落？"}, {"role": "assistant", "content": "日落时光程更长，红光留下。"}]
    if slow.chat_template:
        texts += [slow.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=False) for k in (2, 3, 5)]
    return texts


def convert_and_check(src: str | Path, out: str | Path, *, corpus: Iterable[str] = (), slow=None) -> tuple[Path, int]:
    """Convert the Kimi tokenizer of ``src`` to a fast one, check it id for id against the slow
    tokenizer (the project's code over the same files) on ``check_corpus`` and ``corpus``, and
    save it into ``out`` (``tokenizer.json``, ``tokenizer_config.json``, the chat template) only
    when every text agreed. ``slow``: that slow tokenizer, already loaded. Returns (``out``,
    tokens compared).

    Raises:
        ConversionMismatch: a text tokenized differently; nothing is written.
    """
    import tempfile

    from transformers import AutoTokenizer

    s = Path(src)
    fast = convert(s)
    with tempfile.TemporaryDirectory() as tmp:
        if slow is None:
            template = (s / TEMPLATE_FILE).read_text() if (s / TEMPLATE_FILE).is_file() else None
            slow = AutoTokenizer.from_pretrained(write_slow_tokenizer(s, tmp, chat_template=template), trust_remote_code=True)
        n = check_same_ids(slow, fast, [*check_corpus(slow), *corpus])
    d = Path(out)
    fast.save_pretrained(d)
    log.info("fast Kimi tokenizer written to %s (%d tokens checked against the slow tokenizer)", d, n)
    return d, n


def _corpus_texts(path: Path) -> Iterable[str]:
    """The message contents and reasoning of a chat JSONL file."""
    with path.open() as f:
        for line in f:
            for m in json.loads(line).get("messages", []):
                for key in ("content", "reasoning_content"):
                    if isinstance(m.get(key), str) and m[key]:
                        yield m[key]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m datagen.models.kimi_tokenizer",
                                 description="Convert Kimi's tiktoken tokenizer to a checked fast tokenizer.json.")
    ap.add_argument("model", help="directory with tiktoken.model and tokenizer_config.json (the model's)")
    ap.add_argument("out", help="directory to write the fast tokenizer to (name it as the spec's tokenizer)")
    ap.add_argument("--corpus", type=Path, help="a chat JSONL file whose texts are checked too (e.g. the dataset)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out, n = convert_and_check(args.model, args.out, corpus=_corpus_texts(args.corpus) if args.corpus else ())
    except (FileNotFoundError, ConversionMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {n} tokens identical to the slow tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
