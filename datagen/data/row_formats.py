"""The row formats a dataset may be written in, each turned into one normal form.

Every row of a dataset is recognised by its fields, with nothing to pass:

- ``messages`` (OpenAI chat; UltraChat-200k too): ``{"messages": [{"role", "content", ...}], "tools": [...]}``;
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": "..."}, ...]}`` (``from``/``value`` with
  the roles human, gpt, system, tool, or ``role``/``content``), with ``tools`` and a ``system`` prompt;
- ``ultrachat`` (the original UltraChat): ``{"data": ["user turn", "assistant turn", ...]}``;
- ``tokens``: pre-tokenized ``{"input_ids": [...], "loss_mask": [...]}``.

A chat row becomes ``{"messages": [...]}`` with ``"tools": [...]`` when it has tools: roles mapped
to user/assistant/system/tool, fields that hold null left out, a ``tools`` JSON string parsed, a
content list of text parts joined into its text (a list with images stays, for
``datagen.data.media``), ShareGPT's ``thinking`` named ``reasoning_content``. The normal form is
what the chat template renders, and its canonical JSON is the row's identity (``identity``): the
same chat in ShareGPT or in messages form is the same row, and a changed tool schema is a changed
row. What the normal form may hold is checked in ``datagen.data.row_checks``.
"""

from __future__ import annotations

import enum
import hashlib
import json


from datagen.errors import DatasetError


class RowFormat(str, enum.Enum):
    """How a row is written (recognised from its fields)."""

    MESSAGES = "messages"
    SHAREGPT = "sharegpt"
    ULTRACHAT = "ultrachat"
    TOKENS = "tokens"


# The field that tells each format, in the order they are recognised.
FORMAT_KEYS = {"messages": RowFormat.MESSAGES, "conversations": RowFormat.SHAREGPT, "data": RowFormat.ULTRACHAT,
               "input_ids": RowFormat.TOKENS}
# Fields a chat row may carry beside its turns that no template renders (ids, provenance): left out of
# the normal form. Any other field is refused, so that nothing a template would render is dropped.
METADATA_FIELDS = frozenset({"id", "prompt_id", "prompt", "source", "metadata"})
FORMAT_FIELDS = {f: k for k, f in FORMAT_KEYS.items()}
# The fields a chat row of each format may have.
ALLOWED_FIELDS = {f: frozenset({k, "tools"} | ({"system"} if f is RowFormat.SHAREGPT else set())) | METADATA_FIELDS
                  for k, f in FORMAT_KEYS.items()}
# ShareGPT's speakers, as chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
HINT_FORMATS = ('write {"messages": [{"role": "user", "content": "..."}, ...]}, {"conversations": [{"from": '
                '"human", "value": "..."}, ...]}, {"data": ["user turn", "assistant turn"]} or {"input_ids": [...]}')


def row_format(obj: dict, *, path: str, line: int) -> RowFormat:
    """The format of a parsed row. Raises DatasetError for a row of none (or of two) of them."""
    if len(obj) == 1 and (fmt := FORMAT_KEYS.get(next(iter(obj)))) is not None:
        return fmt  # (a row of its turns alone)
    found = [f for k, f in FORMAT_KEYS.items() if k in obj]
    if len(found) == 1:
        return found[0]
    if not found:
        raise DatasetError(f"row has none of the fields {', '.join(FORMAT_KEYS)} (fields: {sorted(obj)})",
                           path=path, line=line, hint=HINT_FORMATS)
    raise DatasetError(f"row has the fields of several formats ({', '.join(f.value for f in found)})",
                       path=path, line=line, hint="give each row one of them: " + HINT_FORMATS)


def normalise(obj: dict, *, path: str, line: int) -> tuple[RowFormat, dict]:
    """The row's format and its normal form: ``{"messages", "tools"?}`` for a chat, the row itself
    for pre-tokenized ids (checked in ``row_checks``).

    Raises:
        DatasetError: the row is of no known format, has a field no format has, a ShareGPT turn of
            an unknown speaker, or a ``tools`` that is not a list of tools (or its JSON).
    """
    fmt = row_format(obj, path=path, line=line)
    if fmt is RowFormat.TOKENS:
        return fmt, obj
    key = FORMAT_FIELDS[fmt]
    allowed = ALLOWED_FIELDS[fmt]
    if not obj.keys() <= allowed:
        unknown = set(obj) - allowed
        raise DatasetError(
            f"unknown fields {sorted(unknown)} in a {fmt.value} row", path=path, line=line,
            hint=f"a {fmt.value} row has {', '.join(sorted(allowed - METADATA_FIELDS))} (and, ignored, "
                 f"{', '.join(sorted(METADATA_FIELDS))}); "
                 "rename or remove the others",
        )
    turns = obj[key]
    if not isinstance(turns, list):
        raise DatasetError(f"{key} must be a list, got {type(turns).__name__}", path=path, line=line,
                           hint=HINT_FORMATS)
    if fmt is RowFormat.ULTRACHAT:
        messages = _ultrachat(turns, path=path, line=line)
    elif fmt is RowFormat.SHAREGPT:
        messages = [_sharegpt_turn(t, j, path=path, line=line) for j, t in enumerate(turns)]
        system = obj.get("system")
        if system is not None:
            if not isinstance(system, str):
                raise DatasetError("system must be a string", path=path, line=line,
                                   hint="write the system prompt as a JSON string, or as a system turn")
            if system:
                messages.insert(0, {"role": "system", "content": system})
    else:
        messages = [_message(m) for m in turns]
    out = {"messages": messages}
    tools = parse_tools(obj.get("tools"), path=path, line=line)
    if tools:
        out["tools"] = tools
    return fmt, out


def canonical(normal: dict) -> bytes:
    """A row's normal form as canonical JSON (keys sorted, no spaces, UTF-8), by the standard
    library alone: the same bytes in every image (one without a faster encoder would give another
    identity to a row holding a float); ~30 us for a 10 kB row, against milliseconds to tokenize it."""
    return json.dumps(normal, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def identity(normal: dict) -> bytes:
    """sha256 of a row's normal form, as canonical JSON."""
    return hashlib.sha256(canonical(normal)).digest()


def parse_tools(tools, *, path: str, line: int) -> list[dict] | None:
    """A row's tools: a list of tool objects, or the JSON string of one (as exported datasets carry
    it); None or empty for none. Each tool is ``{"type": "function", "function": {"name", ...}}`` or
    a bare ``{"name", ...}``."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DatasetError(f"tools is a string but not valid JSON ({e.msg} at column {e.colno})",
                               path=path, line=line,
                               hint='write tools as a JSON list, or a string holding one: [{"type": "function", '
                                    '"function": {"name": "f", "parameters": {...}}}]') from None
    if not isinstance(tools, list):
        raise DatasetError(f"tools must be a list of tools, got {type(tools).__name__}", path=path, line=line,
                           hint='e.g. [{"type": "function", "function": {"name": "f", "parameters": {...}}}]')
    for k, t in enumerate(tools):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DatasetError(f"tools[{k}] is not a tool with a name", path=path, line=line,
                               hint='each tool is {"type": "function", "function": {"name": "f", ...}} or '
                                    '{"name": "f", ...}')
    return tools


def _message(m) -> dict:
    """A message with its null fields left out, a null content empty (as OpenAI writes a turn that
    only calls tools) and a content list of text parts joined. Anything malformed is passed on as
    it is, for ``row_checks`` to name."""
    if not isinstance(m, dict):
        return m
    if type(m.get("content")) is str and None not in m.values():
        return m  # (most messages: nothing to change)
    out = {k: v for k, v in m.items() if v is not None or k == "role"}  # (a null role is refused by name)
    if "content" not in out and ("content" in m or out.get("tool_calls")):
        out["content"] = ""  # (OpenAI writes a turn that only calls tools with a null content, or none)
    content = out.get("content")
    if isinstance(content, list) and content and all(_is_text_part(p) for p in content):
        # several text parts: joined with newlines, as vLLM joins them for a template that takes a string
        out["content"] = "\n".join(p["text"] for p in content)
    return out


def _is_text_part(p) -> bool:
    return isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and len(p) == 2


def _sharegpt_turn(t, j: int, *, path: str, line: int) -> dict:
    if not isinstance(t, dict):
        raise DatasetError(f"conversations[{j}] must be an object, got {type(t).__name__}", path=path, line=line,
                           hint='e.g. {"from": "human", "value": "hi"}')
    speaker, text = ("from", "value") if "from" in t else ("role", "content")
    if speaker not in t:
        raise DatasetError(f"conversations[{j}] has neither 'from' nor 'role'", path=path, line=line,
                           hint='write {"from": "human", "value": "..."} or {"role": "user", "content": "..."}')
    who = t[speaker]
    if not isinstance(who, str) or who not in SHAREGPT_ROLES:
        raise DatasetError(f"conversations[{j}] has unknown {speaker} {who!r}", path=path, line=line,
                           hint=f"speakers are {', '.join(SHAREGPT_ROLES)}")
    m = {"role": SHAREGPT_ROLES[who]}
    if text in t:
        m["content"] = t[text]
    for k, v in t.items():
        if k in (speaker, text):
            continue
        if k == "thinking":  # ShareGPT exports of thinking models name the reasoning so
            k = "reasoning_content"
        m[k] = v
    return _message(m)


def _ultrachat(turns: list, *, path: str, line: int) -> list[dict]:
    for j, t in enumerate(turns):
        if not isinstance(t, str):
            raise DatasetError(f"data[{j}] must be a string (UltraChat rows alternate user and assistant turns)",
                               path=path, line=line, hint='write {"data": ["user turn", "assistant turn", ...]}')
    return [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(turns)]
