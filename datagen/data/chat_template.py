"""A chat rendered with the model's chat template, and the character spans of its assistant targets.

``target_spans`` renders each prefix of the chat (in two batched calls) and finds where each
assistant turn's target starts and ends in the whole render; a template that cannot render a
prefix refuses the row with its reason (``template_error``). ``datagen.data.chat_tokens`` cuts
the render at those spans and tokenizes it into ids and a loss mask.
"""

from __future__ import annotations

from datagen.errors import DatasetError

TARGET_ROLE = "assistant"


def target_spans(tokenizer, messages: list[dict], *, tools: list[dict] | None = None, path: str = "",
                 line: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The whole chat's render and the character spans of its assistant targets.

    The template is rendered for each prefix of the chat: the text between the prompt for
    assistant turn i (``add_generation_prompt=True``) and the render that includes turn i is that
    turn's target (thinking block, content, tool calls and end-of-turn marker, whatever the
    template writes after the prompt). A chat that opens with the assistant has the render of an
    empty conversation as its first prompt (``render_prompt``); a template that cannot render a
    prefix refuses the row with its reason (``template_error``). Both renders must be prefixes of
    the whole chat's. ``tools`` (the row's tool declarations) go to every render, as a server
    passes them to the template with every request. The
    renders of a row are asked for in two calls (prompts, then the whole chat and the turns'
    ends; a chat ending on its last target turn is that turn's end), as a list of conversations:
    the same renders, without the per-call work of ``apply_chat_template``.
    """
    targets = [i for i, m in enumerate(messages) if m["role"] == TARGET_ROLE]
    try:
        full, starts, ends = _renders(tokenizer, messages, targets, tools)
    except Exception:  # noqa: BLE001 - a template that raises: raise as the renders one by one do
        full, starts, ends = _renders_one_by_one(tokenizer, messages, targets, tools, path=path, line=line)
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


def _render(tokenizer, conversation, gen: bool, tools: list[dict] | None = None):
    return tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False, add_generation_prompt=gen)


def render_prompt(tokenizer, conversation: list[dict], tools: list[dict] | None = None) -> str:
    """The conversation so far with the generation prompt. An empty conversation (the prompt of a
    chat that opens with the assistant) is rendered as a batch of one: transformers refuses an
    empty conversation on its own, but renders it in a batch like any other, so the template
    decides what the render of nothing is (its generation prompt, a BOS, or an error of its own)."""
    if not conversation:
        return _render(tokenizer, [[]], True, tools)[0]
    return _render(tokenizer, conversation, True, tools)


def template_error(e: Exception, *, what: str, path: str, line: int | None) -> DatasetError:
    """A chat template (or tokenizer) that raised, as the row's error: the line, what was being
    rendered, and the template's own reason."""
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return DatasetError(
        f"the chat template cannot render {what}: {type(e).__name__}: {reason}", path=path, line=line,
        hint="fix the chat (the template's reason says what it expects), or pre-tokenize this row with "
             "input_ids and loss_mask",
    )


def _renders_one_by_one(tokenizer, messages, targets, tools=None, *, path: str = "",
                        line: int = 0) -> tuple[str, list[str], list[str]]:
    def attempt(what: str, render):
        try:
            return render()
        except Exception as e:  # noqa: BLE001 - any template error is the row's error
            raise template_error(e, what=what, path=path, line=line) from e

    full = attempt("the chat", lambda: _render(tokenizer, messages, False, tools))
    starts, ends = [], []
    for i in targets:
        starts.append(attempt(f"the prompt of assistant message {i}" + (" (an empty conversation)" if i == 0 else ""),
                              lambda: render_prompt(tokenizer, messages[:i], tools)))
        ends.append(attempt(f"the chat up to message {i}", lambda: _render(tokenizer, messages[: i + 1], False, tools)))
    return full, starts, ends


def _renders(tokenizer, messages, targets, tools) -> tuple[str, list[str], list[str]]:
    if not targets:
        return _renders_one_by_one(tokenizer, messages, targets, tools)
    last = len(messages) - 1
    whole_and_ends = _render(tokenizer, [messages, *(messages[: i + 1] for i in targets if i != last)], False, tools)
    full = whole_and_ends[0]
    ends = list(whole_and_ends[1:]) + ([full] if targets[-1] == last else [])
    # (a batch of conversations: an empty one, the prompt of an opening assistant turn, renders too)
    return full, list(_render(tokenizer, [messages[:i] for i in targets], True, tools)), ends
