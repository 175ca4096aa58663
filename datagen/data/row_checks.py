"""What a row may hold: the checks of a chat row (roles, fields, content, tool calls) and of a
pre-tokenized row (ids in the vocabulary, a 0/1 mask of the same length).

A row that fails raises ``DatasetError`` with its line and what to write instead. A user message's
content that is a list of parts is checked by ``datagen.data.media.check_parts``.
"""

from __future__ import annotations

import numpy as np

from datagen.errors import DatasetError

ROLES = frozenset({"system", "user", "assistant", "tool"})


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
    """The messages of a chat row in its normal form (``datagen.data.row_formats.normalise``),
    checked."""
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
    _check_tool_turns(msgs, path=path, line=line)
    return msgs


def _check_tool_turns(msgs: list[dict], *, path: str, line: int) -> None:
    """Each tool turn answers a call: the turns before it, back to the first that is not a tool
    turn, end at an assistant turn with tool calls, one of which it names when it names one."""
    calls: list[str] | None = None  # the ids of the calls that tool turns now answer
    for j, m in enumerate(msgs):
        if m["role"] == "assistant":
            calls = [c["id"] for c in m["tool_calls"]] if m.get("tool_calls") else None
            continue
        if m["role"] != "tool":
            calls = None
            continue
        if calls is None:
            raise DatasetError(
                f"message {j} is a tool turn without its call (the turn before it is not an assistant turn "
                "with tool_calls)", path=path, line=line,
                hint="give the assistant turn that calls the tool its tool_calls, or drop the tool turn",
            )
        if "tool_call_id" in m and m["tool_call_id"] not in calls:
            raise DatasetError(
                f"message {j} tool_call_id {m['tool_call_id']!r} names no call of the assistant turn before it "
                f"(its calls: {', '.join(calls)})", path=path, line=line,
                hint="set tool_call_id to the id of the tool call this turn answers",
            )


def _valid_tool_calls(calls) -> bool:
    if not isinstance(calls, list):
        return False
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(fn, dict) or not isinstance(c.get("id"), str) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments"), (str, dict))):
            return False
    return True
