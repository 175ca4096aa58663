"""A tiny tokenizer shaped like Kimi-K2.5's: tiktoken BPE, remote code, Kimi's chat template.

Kimi-K2.5 ships no ``tokenizer.json``: ``tiktoken.model`` (base64 token and rank per line),
``tokenization_kimi.py`` (a slow ``PreTrainedTokenizer`` over ``tiktoken``, loaded through
``auto_map`` with ``trust_remote_code``), ``tokenizer_config.json`` naming 256 reserved special
tokens right after the base vocabulary, and ``chat_template.jinja``. ``write_kimi_tokenizer``
writes the same four files into a model directory, with ranks trained here (bytes plus merges
learned on the tiny chat corpus: nothing is downloaded) so that the vocabulary fits the tiny
model's ``vocab_size``.

The chat template is reconstructed from Kimi-K2's public template and what is known of
K2.5's: roles as ``<|im_system|>``/``<|im_user|>``/``<|im_assistant|>`` + name +
``<|im_middle|>``, turns closed by ``<|im_end|>``, a default system prompt when the chat has
none, tool declarations (``tool_declare``), tool calls in ``<|tool_calls_section_begin|>``
sections, tool results as ``## Return of <id>``, and thinking blocks: the history (up to the
last assistant turn without tool calls) keeps an empty ``<think></think>``, the turns after it
keep their ``reasoning_content``; the generation prompt opens ``<think>``.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import shutil
from pathlib import Path

from datagen.models import _tokenization_kimi as kimi_code

log = logging.getLogger(__name__)

RANKS_FILE = "tiktoken.model"
CODE_FILE = "tokenization_kimi.py"
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
RESERVED = kimi_code.NUM_RESERVED_SPECIAL_TOKENS
# Named special tokens at id len(ranks) + offset, in the real layout (163584 + offset there): Kimi-K2's
# tokenizer_config.json for offsets 0-17, 254, 255, and Kimi-K2.5's additions (media tokens 163602-163605,
# <think> 163606, </think> 163607); every other reserved id is <|reserved_token_<id>|>.
SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
# The tool-call markers are added tokens with "special": false in the real config (kept by
# skip_special_tokens), and only these are listed as additional_special_tokens there.
NOT_SPECIAL_OFFSETS = frozenset(range(11, 16))
MEDIA_PAD_OFFSET = 21  # <|media_pad|>: 163605 in the real layout
ADDITIONAL_SPECIAL_OFFSETS = (2, 3, 4, 6, 7, 9, 10, 17)
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

CHAT_TEMPLATE = (
    "{%- macro render_content(msg) -%}"
    "{%- set c = msg.get('content') -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is not none -%}{%- for part in c -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}<|media_begin|>{{ part['type'] }}<|media_content|><|media_pad|><|media_end|>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro set_roles(message) -%}"
    "{%- set role_name = message.get('name') or message['role'] -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>{{ role_name }}<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|>"
    "{%- else -%}<|im_system|>{{ role_name }}<|im_middle|>{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro render_toolcalls(message) -%}"
    "<|tool_calls_section_begin|>"
    "{%- for tool_call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>"
    "{%- if tool_call['function']['arguments'] is string -%}{{ tool_call['function']['arguments'] }}"
    "{%- else -%}{{ tool_call['function']['arguments'] | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endmacro -%}"
    "{%- macro render_message(message, keep_reasoning) -%}"
    "{{- set_roles(message) -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- if keep_reasoning and not (thinking is defined and thinking is false) -%}"
    "<think>{{ message.get('reasoning_content') or '' }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{- render_content(message) -}}"
    "{%- if message.get('tool_calls') -%}{{- render_toolcalls(message) -}}{%- endif -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "## Return of {{ message.get('tool_call_id') }}\n{{ render_content(message) }}"
    "{%- else -%}{{- render_content(message) -}}{%- endif -%}"
    "<|im_end|>"
    "{%- endmacro -%}"
    # History: up to the last assistant turn without tool calls; reasoning is kept after it only.
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for idx in range(messages|length - 1, -1, -1) -%}"
    "{%- if ns.last == -1 and messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}"
    "{%- set ns.last = idx -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages[:ns.last + 1] -%}{{- render_message(message, false) -}}{%- endfor -%}"
    "{%- for message in messages[ns.last + 1:] -%}{{- render_message(message, true) -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


def train_ranks(corpus: list[str], *, n_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then merges learned on ``corpus`` in order of pair
    frequency (ties broken by the pair's bytes), pre-tokenized with Kimi's pattern. When the
    corpus has no pair left, further merges join existing tokens in a fixed order, so that there
    are exactly ``n_ranks`` (the model's vocabulary minus the reserved special ids)."""
    import regex

    if n_ranks < 256:
        raise ValueError(f"a byte-level BPE needs at least 256 ranks, got {n_ranks}")
    pattern = regex.compile(kimi_code.PAT_STR, flags=regex.V1)
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    words = collections.Counter(w.encode() for text in corpus for w in pattern.findall(text))
    pieces = {w: [w[i : i + 1] for i in range(len(w))] for w in words}
    while len(ranks) < n_ranks:
        pairs: collections.Counter = collections.Counter()
        for w, parts in pieces.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if a + b not in ranks:  # another merge path may have made this token already
            ranks[a + b] = len(ranks)
        for w, parts in pieces.items():
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            pieces[w] = merged
    letters = [bytes([c]) for c in b" etaoinsrhldcumfpgwybvkxjqz"]
    for a in list(ranks):
        for b in letters:
            if len(ranks) >= n_ranks:
                return ranks
            ranks.setdefault(a + b, len(ranks))
    return ranks


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """The tiktoken ranks file format: ``base64(token) rank`` per line, by rank."""
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("\n".join(lines) + "\n")


def tokenizer_config(base: int) -> dict:
    """tokenizer_config.json as Kimi's: auto_map to the remote class, the reserved specials."""
    added = {
        str(base + off): {"content": SPECIAL_OFFSETS.get(off, f"<|reserved_token_{base + off}|>"), "lstrip": False,
                          "normalized": False, "rstrip": False, "single_word": False,
                          "special": off not in NOT_SPECIAL_OFFSETS}
        for off in range(RESERVED)
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [SPECIAL_OFFSETS[o] for o in ADDITIONAL_SPECIAL_OFFSETS],
        "auto_map": {"AutoTokenizer": [f"{CODE_FILE[:-3]}.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }


def write_kimi_tokenizer(model_dir: str | Path, *, vocab_size: int, corpus: list[str] | None = None) -> Path:
    """Write a Kimi-shaped tiktoken tokenizer into the existing ``model_dir``.

    Args:
        model_dir: a model directory (it must exist; files of the same names are replaced).
        vocab_size: the model's vocabulary; the ranks take ``vocab_size - 256`` ids and the
            reserved special tokens the last 256, as in Kimi-K2.5 (163584 + 256 = 163840).
        corpus: texts the merges are learned on (default: the tiny chat corpus of datagen.testmodels.tiny).

    Returns:
        ``model_dir``. Load it with ``AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)``.
    """
    from datagen.testmodels.tiny import _corpus

    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {d} does not exist; write the model first")
    if vocab_size < 256 + RESERVED:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for 256 bytes and {RESERVED} special tokens")
    ranks = train_ranks(corpus if corpus is not None else _corpus(2000, seed=0) + [DEFAULT_SYSTEM_PROMPT, "user assistant system tool"], n_ranks=vocab_size - RESERVED)
    write_ranks(ranks, d / RANKS_FILE)
    shutil.copyfile(kimi_code.__file__, d / CODE_FILE)
    (d / TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
    (d / CONFIG_FILE).write_text(json.dumps(tokenizer_config(len(ranks)), indent=2) + "\n")
    _align_media_placeholder(d, len(ranks) + MEDIA_PAD_OFFSET)
    log.info("Kimi-shaped tiktoken tokenizer (%d ranks + %d special) written to %s", len(ranks), RESERVED, d)
    return d


def _align_media_placeholder(d: Path, pad_id: int) -> None:
    """The model's ``media_placeholder_token_id`` set to the tokenizer's ``<|media_pad|>``, as in the
    released checkpoint (163605 both). The ranks learned on a small corpus can be fewer than asked,
    which moves the special tokens down; vLLM takes the tokenizer's id and warns when the config
    disagrees, and so does planning (``datagen.data.media.PAD_TOKEN``)."""
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        return
    cfg = json.loads(cfg_path.read_text())
    changed = False
    for c in (cfg, cfg.get("text_config") or {}):
        if "media_placeholder_token_id" in c and c["media_placeholder_token_id"] != pad_id:
            c["media_placeholder_token_id"], changed = pad_id, True
    if changed:
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
