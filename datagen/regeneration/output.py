"""The regenerated dataset directory: chunk files while it runs, then the dataset and its manifest.

    OUT/chats.jsonl     the regenerated chats, one ``{"messages": [...]}`` per line (with the source
                        row's ``tools``, when it had them): what
                        ``datagen extract --dataset OUT/chats.jsonl`` reads like any dataset
    OUT/lineage.jsonl   line i: where chat i came from (its source row) and each generated turn's
                        token ids, finish ("stop" or "length") and seed; the assistant turns kept
                        as written
    OUT/turns.jsonl     the as-generated layout (datagen.regeneration.turns): line j is one generated
                        turn, ``{"input_ids": [...], "loss_mask": [...]}``, the prompt the engine
                        was given and the ids it generated; the manifest's ``turn_rows`` says
                        which chat and message each line is. ``dataset`` in the manifest names the
                        file extraction reads (the spec's ``layout``)
    OUT/manifest.json   written LAST (its presence means complete): the source file's sha256, the
                        model and its revision, the sampling settings, the engine and its version,
                        the seed, the source row of every output row, the skipped rows, totals

While it runs, ``OUT/.chunks/chunk-<k>.json`` holds chunk k (rows [k*C, (k+1)*C) of the source),
written atomically, with the run's fingerprint: a killed run resumes at the first missing chunk.
Every file is written to a temporary name and renamed; ``.chunks`` is removed after the manifest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from datagen.data.files import atomic_write_bytes, atomic_write_json
from datagen.specs.extraction import sha256_hex
from datagen.errors import OutputConflictError

CHATS = "chats.jsonl"
TURNS = "turns.jsonl"
LINEAGE = "lineage.jsonl"
MANIFEST = "manifest.json"
CHUNKS = ".chunks"
RUN_RECORD = "run.json"


class SkippedChat(BaseModel):
    """A source row that is not in the output, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    row: int = Field(description="The source dataset row (0-based line).")
    reason: str = Field(description="empty, no_user_turn, tool_calls, nothing_to_generate, prompt_too_long, length.")
    message: int | None = Field(None, description="The message index of the turn that decided it, where one did.")
    prompt_tokens: int | None = Field(None, description="prompt_too_long: the prompt's tokens.")
    window: int | None = Field(None, description="prompt_too_long: the model's window (max_model_len).")


class ChunkRecord(BaseModel):
    """One chunk's output: its rows in source order (``.chunks/chunk-<k>.json``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fingerprint: str = Field(description="The regeneration's fingerprint: a chunk of another run is not reused.")
    chunk: int = Field(description="Chunk index k: source rows [k*C, (k+1)*C).")
    rows_sha256: str = Field(description="sha256 over the chunk's source lines.")
    chats: list[dict] = Field(description="The regenerated chats ({messages}) of the rows kept.")
    lineage: list[dict] = Field(description="Per chat: source_row, turns, kept.")
    skipped: list[SkippedChat] = Field(description="The chunk's rows left out.")
    cut: list[dict] = Field(description="on_length drop: rows cut before a turn ({row, message}).")
    turns: list[dict] = Field(default_factory=list, description="The as-generated rows of the chunk's generated "
                              "turns ({source_row, message, input_ids, loss_mask}), in output order.")


class RegenerationManifest(BaseModel):
    """``OUT/manifest.json``: what the regeneration was and where every output row came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int
    kind: str = Field("regeneration", description="What made this directory.")
    fingerprint: str = Field(description="sha256 of what decides the bytes (settings.fingerprint).")
    source: dict = Field(description="The input JSONL: path, sha256, rows.")
    model: dict = Field(description="Model directory, revision (resolved or content hash), architecture.")
    tokenizer: dict = Field(description="sha256 of the chat template and of the tokenizer.")
    engine: dict = Field(description="name, version, dtype, tensor_parallel_size, max_model_len.")
    settings: dict = Field(description="The RegenerationSettings, every field.")
    sampling: dict = Field(description="greedy, or temperature/top_p/top_k/seed; max_new_tokens.")
    seed: int = Field(description="The run's seed (each turn's own seed is in lineage.jsonl).")
    chunks: dict = Field(description="rows_per_chunk and the number of chunks.")
    dataset: str = Field(CHATS, description="The file of this directory that extraction reads: chats.jsonl "
                         "(layout chats) or turns.jsonl (layout as-generated).")
    files: dict = Field(description="chats.jsonl, lineage.jsonl and turns.jsonl: sha256, bytes, rows.")
    totals: dict = Field(description="Counts: rows in and out, skipped by reason, turns, tokens, length hits.")
    rows: list[int] = Field(description="The source row of each output row (output row i = line i of chats.jsonl).")
    skipped: list[SkippedChat] = Field(description="Every source row left out, with its reason.")
    cut: list[dict] = Field(description="on_length drop: rows cut before a turn that hit the limit.")
    turn_rows: list[list[int]] = Field(default_factory=list, description="Line j of turns.jsonl: [output chat, "
                                       "message index] of the generated turn it holds.")


def _line(obj) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True) + "\n").encode()


def chat_line(chat: dict) -> bytes:
    """One line of chats.jsonl, ``{"messages", "tools"?}`` (compact, keys sorted: the same chat gives
    the same bytes)."""
    return _line(chat)


class OutputDir:
    """The output directory of one regeneration (see the module docstring)."""

    def __init__(self, out: str | Path, fingerprint: str):
        self.root = Path(out)
        self.fingerprint = fingerprint
        self.chunks = self.root / CHUNKS

    def finished(self) -> RegenerationManifest | None:
        """The manifest when this regeneration is complete here; OutputConflictError when the
        directory holds something else."""
        man = self.root / MANIFEST
        if man.is_file():
            try:
                m = RegenerationManifest.model_validate_json(man.read_bytes())
            except ValueError:
                m = None
            if m is not None and m.fingerprint == self.fingerprint:
                return m
            raise OutputConflictError(
                f"{self.root} holds a finished dataset of another regeneration or another step",
                hint="choose a new --out, or delete that directory first")
        return None

    def check_resumable(self) -> None:
        """Refuse a directory that holds anything but this run's chunks (nothing is touched)."""
        if not self.root.exists():
            return
        if not self.root.is_dir():
            raise OutputConflictError(f"{self.root} exists and is not a directory", hint="choose a new --out")
        entries = {p.name for p in self.root.iterdir()}
        if not entries:
            return
        record = self.chunks / RUN_RECORD
        if entries <= {CHUNKS, CHATS, LINEAGE, TURNS} and record.is_file():
            try:
                theirs = json.loads(record.read_text()).get("fingerprint")
            except ValueError:
                theirs = None
            if theirs == self.fingerprint:
                return
            raise OutputConflictError(
                f"{self.root} holds an unfinished regeneration of another spec (fingerprint {theirs})",
                hint="re-run with that spec to finish it, choose a new --out, or delete the directory")
        raise OutputConflictError(f"{self.root} exists and is not a regeneration's output "
                                  f"(it holds {', '.join(sorted(entries)[:5])})",
                                  hint="choose a new --out, or delete that directory first")

    def begin(self) -> None:
        self.chunks.mkdir(parents=True, exist_ok=True)
        record = self.chunks / RUN_RECORD
        if not record.is_file():
            atomic_write_json(record, {"fingerprint": self.fingerprint})

    def _chunk_path(self, k: int) -> Path:
        return self.chunks / f"chunk-{k:06d}.json"

    def done_chunk(self, k: int, rows_sha256: str) -> ChunkRecord | None:
        """Chunk k as an earlier run of this spec wrote it, or None."""
        p = self._chunk_path(k)
        if not p.is_file():
            return None
        try:
            rec = ChunkRecord.model_validate_json(p.read_bytes())
        except ValueError:
            return None  # torn or foreign: generated again
        if rec.fingerprint != self.fingerprint or rec.rows_sha256 != rows_sha256 or rec.chunk != k:
            return None
        return rec

    def write_chunk(self, rec: ChunkRecord) -> None:
        atomic_write_bytes(self._chunk_path(rec.chunk), rec.model_dump_json().encode())

    def finish(self, chunks: list[ChunkRecord], manifest: dict) -> RegenerationManifest:
        """Write chats.jsonl, lineage.jsonl and turns.jsonl from the chunks, then the manifest, then drop
        the chunks."""
        chats = b"".join(chat_line(c) for rec in chunks for c in rec.chats)
        lineage = b"".join(_line({"row": i, **entry})
                           for i, entry in enumerate(e for rec in chunks for e in rec.lineage))
        rows = [e["source_row"] for rec in chunks for e in rec.lineage]
        chat_of = {row: i for i, row in enumerate(rows)}
        generated = [t for rec in chunks for t in rec.turns]
        turns = b"".join(_line({"input_ids": t["input_ids"], "loss_mask": t["loss_mask"]}) for t in generated)
        atomic_write_bytes(self.root / CHATS, chats)
        atomic_write_bytes(self.root / LINEAGE, lineage)
        atomic_write_bytes(self.root / TURNS, turns)
        files = {name: {"sha256": sha256_hex(data), "bytes": len(data), "rows": n}
                 for name, data, n in ((CHATS, chats, len(rows)), (LINEAGE, lineage, len(rows)),
                                       (TURNS, turns, len(generated)))}
        m = RegenerationManifest.model_validate({
            **manifest, "fingerprint": self.fingerprint, "files": files, "rows": rows,
            "turn_rows": [[chat_of[t["source_row"]], t["message"]] for t in generated],
            "skipped": [s for rec in chunks for s in rec.skipped], "cut": [c for rec in chunks for c in rec.cut],
        })
        atomic_write_bytes(self.root / MANIFEST, (m.model_dump_json(indent=1) + "\n").encode())
        shutil.rmtree(self.chunks, ignore_errors=True)
        return m
