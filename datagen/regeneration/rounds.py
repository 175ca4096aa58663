"""A chunk's rows regenerated on a started engine, in rounds (``datagen.regeneration.chats``).

Round r renders, for every row still going, the conversation so far with the model's chat
template and generation prompt, and generates all those turns in one batch; the generated ids
are decoded by the same tokenizer (and split into reasoning and content for a thinking model).
A prompt that leaves no room in the model's window skips its row (listed); a turn gets at most
``max_new_tokens``, or what the window leaves.

``ChunkRunner.run_all`` keeps the engine busy between chunks: while chunk k generates, a thread
prepares chunk k+1 (its scripts and its first round's prompts: the chat template and the
tokenizer) and writes chunk k-1's file. The engine runs in its own process, so the host work
overlaps the GPU's; what each chunk holds does not depend on it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from datagen.data.chat_template import render_prompt, template_error
from datagen.errors import DatasetError
from datagen.regeneration.chats import RowState, script
from datagen.regeneration.output import ChunkRecord, SkippedChat
from datagen.regeneration.settings import RegenerationSettings, row_seed
from datagen.regeneration.turns import turn_rows

log = logging.getLogger(__name__)


# (source row, its identity's bytes, messages, tools or None), in source order
Rows = list[tuple[int, bytes, list[dict], list[dict] | None]]


@dataclass
class Prepared:
    """A chunk before its first generation: each row's state, the rows skipped by their script, the
    rows with a turn to generate, and their first round's prompt ids (one per row of ``going``)."""

    states: list[RowState]
    skipped: list[SkippedChat]
    going: list[RowState]
    first_ids: list[list[int]]


class ChunkRunner:
    """Regenerates chunks of rows with a started ``Generator``."""

    def __init__(self, settings: RegenerationSettings, tokenizer, generator, splitter, window: int, *,
                 source: str = "the dataset"):
        self.s, self.tok, self.gen, self.splitter, self.window = settings, tokenizer, generator, splitter, window
        self.source = source  # the dataset's path, for the errors that name a row of it
        # one tokenizer, two threads (run_all): a fast tokenizer is not safe to call from both at once
        self._tok_lock = threading.Lock()

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation so far with the generation prompt, as extraction tokenizes a render."""
        return self.prompts_ids([messages], tools=[tools])[0]

    def prompts_ids(self, conversations: list[list[dict]], rows: list[int] | None = None,
                    tools: list[list[dict] | None] | None = None) -> list[list[int]]:
        """``prompt_ids`` of many conversations, tokenized in one call (a fast tokenizer batches it).
        ``rows``: each conversation's source row, named by the error of a template that cannot
        render it (an empty conversation, the prompt of a chat that opens with the assistant, is
        rendered as extraction renders it: ``render_prompt``); ``tools``: each one's tool declarations.

        Raises:
            DatasetError: the template cannot render a prompt, renders it as nothing, or the
                tokenizer raises on it.
        """
        if not conversations:
            return []
        lines = [r + 1 for r in rows] if rows is not None else [None] * len(conversations)
        tools = tools or [None] * len(conversations)
        with self._tok_lock:
            texts = [self._render(m, line, t) for m, line, t in zip(conversations, lines, tools)]
            try:
                ids = [list(x) for x in self.tok(texts, add_special_tokens=False)["input_ids"]]
            except Exception as e:  # noqa: BLE001 - the tokenizer's own error, as the dataset's
                raise DatasetError(f"the tokenizer cannot tokenize a rendered prompt: {type(e).__name__}: {e}",
                                   path=self.source, hint="check the tokenizer with the chats of this dataset") from e
        for got, m, line in zip(ids, conversations, lines):
            if not got:
                raise DatasetError(
                    f"the chat template renders nothing before assistant message {len(m)}: there is no prompt to "
                    "generate it from", path=self.source, line=line,
                    hint="start the chat with a system or user message, or extract it as written")
        return ids

    def _render(self, messages: list[dict], line: int | None, tools: list[dict] | None = None) -> str:
        try:
            return render_prompt(self.tok, messages, tools)
        except Exception as e:  # noqa: BLE001 - any template error is the row's error
            raise template_error(e, what=f"the prompt of assistant message {len(messages)}", path=self.source,
                                 line=line) from e

    def prepare(self, rows: Rows) -> Prepared:
        """A chunk's scripts and its first round's prompts: host work only, no engine."""
        states: list[RowState] = []
        skipped: list[SkippedChat] = []
        for row, _raw, messages, tools in rows:
            steps = script(messages, self.s.tool_rows)
            if isinstance(steps, str):
                skipped.append(SkippedChat(row=row, reason=steps))
            else:
                states.append(RowState(row=row, steps=steps, tools=tools))
        going = [st for st in states if st.advance()]
        return Prepared(states, skipped, going, self._prompts(going))

    def _prompts(self, going: list[RowState]) -> list[list[int]]:
        return self.prompts_ids([st.out for st in going], [st.row for st in going], [st.tools for st in going])

    def run(self, k: int, rows: Rows, *, fp: str, rows_sha256: str, prepared: Prepared | None = None) -> ChunkRecord:
        """Chunk ``k`` (``prepared``: ``prepare(rows)``, made beforehand)."""
        from datagen.regeneration.generator import TurnRequest
        from datagen.regeneration.reasoning import assistant_message

        p = prepared if prepared is not None else self.prepare(rows)
        self.gen.new_chunk()
        states, going, ids_of_round = p.states, p.going, p.first_ids
        rounds = 0
        while True:
            batch: list[tuple[RowState, TurnRequest]] = []
            for st, ids in zip(going, ids_of_round):
                if len(ids) >= self.window:
                    st.skip("prompt_too_long", message=len(st.out), prompt_tokens=len(ids), window=self.window)
                    continue
                seed = None if self.s.greedy else row_seed(self.s.seed, st.row, len(st.out))
                batch.append((st, TurnRequest(ids, min(self.s.max_new_tokens, self.window - len(ids)), seed)))
            if not batch:
                break
            rounds += 1
            generated = self.gen.generate([r for _, r in batch])
            with self._tok_lock:
                texts = self.tok.batch_decode([list(g.token_ids) for g in generated], skip_special_tokens=False)
            for (st, req), gen, text in zip(batch, generated, texts):
                st.add_turn(assistant_message(text, self.splitter), gen, seed=req.seed, on_length=self.s.on_length,
                            prompt_ids=req.prompt_ids)
            going = [st for st in states if st.advance()]
            ids_of_round = self._prompts(going)
        log.debug("chunk %d: %d rounds", k, rounds)
        return _record(states, list(p.skipped), fp=fp, k=k, rows_sha256=rows_sha256)

    def run_all(self, chunks: Sequence[tuple[int, Rows, str]], *, fp: str,
                write: Callable[[ChunkRecord], None]) -> Iterator[ChunkRecord]:
        """Chunks ``(k, rows, rows_sha256)`` in order, each record yielded once ``write`` (its file) has
        returned; chunk k+1 is prepared and chunk k's file written while the engine generates."""
        if not chunks:
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="regenerate-host") as pool:
            nxt: Future = pool.submit(self.prepare, chunks[0][1])
            pending: tuple[Future, ChunkRecord] | None = None
            for i, (k, rows, key) in enumerate(chunks):
                prepared = nxt.result()
                if i + 1 < len(chunks):
                    nxt = pool.submit(self.prepare, chunks[i + 1][1])
                rec = self.run(k, rows, fp=fp, rows_sha256=key, prepared=prepared)
                if pending is not None:
                    pending[0].result()
                    yield pending[1]
                pending = (pool.submit(write, rec), rec)
            pending[0].result()
            yield pending[1]


def _record(states: list[RowState], skipped: list[SkippedChat], *, fp: str, k: int, rows_sha256: str) -> ChunkRecord:
    chats, lineage, cut, turns = [], [], [], []
    for st in states:
        if st.skipped is not None:
            skipped.append(SkippedChat(row=st.row, reason=st.skipped, **(st.skip_detail or {})))
            continue
        if st.cut_at is not None:
            cut.append({"row": st.row, "message": st.cut_at})
        chats.append({"messages": st.out, **({"tools": st.tools} if st.tools else {})})
        lineage.append({"source_row": st.row, "turns": st.turns, "kept": st.kept})
        turns.extend({"source_row": st.row, **r} for r in turn_rows(st.prompts.__getitem__, st.turns))
    skipped.sort(key=lambda s: s.row)
    return ChunkRecord(fingerprint=fp, chunk=k, rows_sha256=rows_sha256, chats=chats, lineage=lineage,
                       skipped=skipped, cut=cut, turns=turns)
