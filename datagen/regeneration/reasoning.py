"""A thinking model's generated reasoning, split from its answer by vLLM's own reasoning parsers.

Kimi-K2.5 (``kimi_k2``), DeepSeek-R1 (``deepseek_r1``), Qwen3 (``qwen3``) and the others vLLM
registers write their reasoning between markers the parser knows; the reasoning goes to the
message's ``reasoning_content`` and the rest to ``content``, the fields the chat templates render
(so extraction renders the turn as the model wrote it). The parser is vLLM's, never re-written here.
"""

from __future__ import annotations

from datagen.errors import SpecError


class ReasoningSplitter:
    """``split(text) -> (reasoning or None, content)`` with the named vLLM parser."""

    def __init__(self, name: str, tokenizer):
        from vllm.reasoning import ReasoningParserManager

        try:
            cls = ReasoningParserManager.get_reasoning_parser(name)
        except KeyError:
            known = ", ".join(sorted(ReasoningParserManager.list_registered()))
            raise SpecError(f"reasoning_parser {name!r} is not one of vLLM's reasoning parsers",
                            hint=f"use one of: {known}") from None
        try:
            self.parser = cls(tokenizer)
        except (ValueError, RuntimeError) as e:
            raise SpecError(f"reasoning_parser {name!r} does not fit this model's tokenizer: {e}",
                            hint="pick the parser of this model family, or leave reasoning_parser out") from e
        self.name = name

    def split(self, text: str) -> tuple[str | None, str]:
        # A complete (non-streamed) output; the parsers used offline do not read the request.
        reasoning, content = self.parser.extract_reasoning(text, None)
        return reasoning, content or ""


def assistant_message(text: str, splitter: ReasoningSplitter | None) -> dict:
    """The generated turn as a chat message."""
    if splitter is None:
        return {"role": "assistant", "content": text}
    reasoning, content = splitter.split(text)
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message
