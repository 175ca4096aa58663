"""Turn by turn: what becomes of each message of a chat, and a row's state while it is regenerated.

A row's ``Script`` lists its steps in order: keep a message (system, user, tool, and with
``keep-tool-turns`` an assistant turn carrying tool calls) or generate an assistant turn from the
conversation so far. Every assistant turn of the input without tool calls is generated again (its
text and reasoning are dropped), and a chat that ends on a user or tool message gets one more
assistant turn at its end, so a dataset of prompts alone is regenerated too. Generation runs in
rounds: round r generates the r-th generated turn of every row still going, so a turn's prompt
holds the turns generated before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from datagen.regeneration.settings import OnLength, ToolRows

GENERATE = "generate"
KEEP = "keep"

# Why a row is left out of the output (manifest ``skipped``).
SkipReason = Literal["empty", "no_user_turn", "tool_calls", "nothing_to_generate", "prompt_too_long", "length"]
Finish = Literal["stop", "length"]


@dataclass(frozen=True)
class Step:
    """One step of a row's script."""

    action: Literal["keep", "generate"]
    message: dict | None = None  # the message kept (None for a generated turn)
    kept_because: str | None = None  # "tool_calls" for an assistant turn kept as written


def script(messages: list[dict], tool_rows: ToolRows) -> list[Step] | SkipReason:
    """The steps of one chat, or why it is skipped."""
    if not messages:
        return "empty"
    if not any(m["role"] == "user" for m in messages):
        return "no_user_turn"
    calls = any(m["role"] == "assistant" and m.get("tool_calls") for m in messages)
    if calls and tool_rows is ToolRows.SKIP:
        return "tool_calls"
    steps: list[Step] = []
    for m in messages:
        if m["role"] != "assistant":
            steps.append(Step(KEEP, m))
        elif m.get("tool_calls"):
            steps.append(Step(KEEP, m, kept_because="tool_calls"))
        else:
            steps.append(Step(GENERATE))
    if messages[-1]["role"] in ("user", "tool"):
        steps.append(Step(GENERATE))
    if not any(s.action == GENERATE for s in steps):
        return "nothing_to_generate"
    return steps


@dataclass(frozen=True)
class Generated:
    """What the engine returned for one turn."""

    token_ids: tuple[int, ...]  # generated ids, the stop token left out
    finish: Finish  # "stop": the model ended the turn; "length": max_new_tokens or the window
    stop_token: int | None = None  # the stop token that ended a "stop" turn


@dataclass
class RowState:
    """A row while its turns are generated."""

    row: int  # the source dataset row (0-based line)
    steps: list[Step]
    tools: list[dict] | None = None  # the source row's tool declarations: in every prompt, and kept in the output
    pos: int = 0  # the next step
    out: list[dict] = field(default_factory=list)  # the regenerated chat so far
    turns: list[dict] = field(default_factory=list)  # lineage of each generated turn
    kept: list[dict] = field(default_factory=list)  # lineage of each assistant turn kept as written
    prompts: dict[int, list[int]] = field(default_factory=dict)  # message -> the prompt ids its turn was generated from
    skipped: SkipReason | None = None
    skip_detail: dict | None = None
    cut_at: int | None = None  # on_length drop: index (in the output chat) where the chat was cut

    def advance(self) -> bool:
        """Keep messages up to the next turn to generate; True when there is one."""
        while self.pos < len(self.steps) and self.steps[self.pos].action == KEEP:
            step = self.steps[self.pos]
            if step.kept_because:
                self.kept.append({"message": len(self.out), "reason": step.kept_because})
            self.out.append(step.message)
            self.pos += 1
        return self.skipped is None and self.cut_at is None and self.pos < len(self.steps)

    def skip(self, reason: SkipReason, **detail) -> None:
        self.skipped, self.skip_detail = reason, detail or None

    def add_turn(self, message: dict, gen: Generated, *, seed: int | None, on_length: OnLength,
                 prompt_ids: list[int] | None = None) -> None:
        """Append a generated turn (``message``: role, content, maybe reasoning_content) generated
        from ``prompt_ids``."""
        at = len(self.out)
        if gen.finish == "length" and on_length is OnLength.DROP:
            self.cut_at = at
            while self.out and self.out[-1]["role"] != "assistant":
                self.out.pop()
            self.turns = [t for t in self.turns if t["message"] < len(self.out)]
            self.kept = [k for k in self.kept if k["message"] < len(self.out)]
            if not self.turns:
                self.skip("length", message=at)
            return
        turn = {"message": at, "finish": gen.finish, "tokens": len(gen.token_ids), "token_ids": list(gen.token_ids)}
        if gen.stop_token is not None:
            turn["stop_token"] = gen.stop_token
        if seed is not None:
            turn["seed"] = seed
        self.turns.append(turn)
        if prompt_ids is not None:
            self.prompts[at] = prompt_ids
        self.out.append(message)
        self.pos += 1
