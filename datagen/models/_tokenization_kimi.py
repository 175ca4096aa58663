"""A slow tiktoken tokenizer shaped like Kimi-K2.5's ``tokenization_kimi.py`` (remote code).

``datagen.testmodels.tiny_tiktoken`` copies this file into a model directory as ``tokenization_kimi.py``;
transformers imports it there through ``auto_map`` when ``trust_remote_code`` is set. It is the
same kind of object as the real one: a ``PreTrainedTokenizer`` (no ``tokenizer.json``, no
character offsets) over a ``tiktoken.Encoding`` built from ``tiktoken.model`` (base64 token,
rank per line) with Kimi's pre-tokenization pattern, 256 reserved special-token ids right after
the base vocabulary, and ``apply_chat_template`` defaulting to ``add_generation_prompt=True``.
It imports only tiktoken and transformers, so it runs wherever a model's code would.
"""

from __future__ import annotations

import os
from pathlib import Path
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

# Kimi's pattern: Han runs, cased words with English contractions, 1-3 digits, punctuation runs
# (with trailing newlines), newlines, spaces.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map (the token strings of a byte-level BPE).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TikTokenTokenizer(PreTrainedTokenizer):
    """Kimi-style tokenizer: tiktoken BPE, special tokens at ids ``len(ranks) + k``."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]",
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"tiktoken ranks file {vocab_file} does not exist")
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        named = {int(i): (t.content if hasattr(t, "content") else t["content"])
                 for i, t in (added_tokens_decoder or {}).items()}
        self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(base, base + NUM_RESERVED_SPECIAL_TOKENS)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=PAT_STR, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.n_words = self.model.n_vocab
        byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in byte_encoder.items()}
        self.decoder = {i: "".join(byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(base)}
        self.decoder.update({i: s for s, i in self.special_tokens.items()})
        self.encoder = {s: i for i, s in self.decoder.items()}
        if additional_special_tokens is None:
            additional_special_tokens = [s for s in named.values() if s not in (bos_token, eos_token, unk_token, pad_token)]
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def encode(self, text, allow_special_tokens=True, **kwargs):
        # As Kimi's: a plain string is encoded by tiktoken directly, special tokens included.
        if kwargs or not isinstance(text, str):
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.model.encode(text, disallowed_special=())]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.special_tokens.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        out, buf = [], bytearray()
        for t in tokens:
            if t in self.special_tokens:
                out.append(buf.decode("utf-8", "replace") + t)
                buf = bytearray()
            else:
                buf.extend(self.byte_decoder[c] for c in t)
        return "".join(out) + buf.decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"])
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)

    def apply_chat_template(self, conversation, tools=None, tokenize=False, add_generation_prompt=True, **kwargs):
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
