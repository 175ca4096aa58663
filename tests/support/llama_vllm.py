"""The tiny Llama's eager vLLM extraction that the engine modules only read, built once per pytest
process (two modules asking for it get the same one, as with ``extracted_dataset``):

- ``tests/test_extract_vllm.py``: the reference comparisons, the byte comparisons of the killed
  run, the stored plan's range, TP2, fp8 and the compiled striped run;
- ``tests/test_public_capture.py``: the internal capture's shards the public path must write byte
  for byte.

Unequal lengths; 700 and 1500 exceed the per-step budget of 256 tokens (chunked prefill); 1500 is
also cut to max_seq_len; row 8 is empty and row 9 has no target token (skipped).
"""

from __future__ import annotations

from pathlib import Path

from tests.builders import result_of, run_datagen, token_rows, write_jsonl

LENGTHS = [1, 7, 33, 300, 700, 1500, 64, 12, 0, 5, 90, 41, 250, 3]
NO_TARGET_ROW = 9
BUDGET = 256
MAX_SEQ_LEN = 1024
PER_SHARD = 4
EAGER = {"DATAGEN_ENFORCE_EAGER": "1"}

_built: dict[str, object] = {}


def extract_args(model: Path, data: Path, out: Path, *extra: str) -> tuple[str, ...]:
    """``datagen extract`` of these rows with the module's settings (the vLLM engine)."""
    return ("extract", "--model", str(model), "--dataset", str(data), "--out", str(out), "--engine", "vllm",
            "--max-seq-len", str(MAX_SEQ_LEN), "--samples-per-shard", str(PER_SHARD),
            "--max-num-batched-tokens", str(BUDGET), *extra)


def llama_rows(tmp_path_factory) -> Path:
    if "rows" not in _built:
        rows = token_rows(LENGTHS, masks={NO_TARGET_ROW: [0] * 5})
        _built["rows"] = write_jsonl(tmp_path_factory.mktemp("rows") / "rows.jsonl", rows)
    return _built["rows"]


def llama_vllm(tmp_path_factory, tiny_llama: Path) -> tuple[Path, dict]:
    """(output, result line) of the eager internal-capture extraction of ``llama_rows``; its engine's
    steps are written beside the output (``steps.json``, DATAGEN_STEP_TRACE), which changes no byte."""
    if "vllm" not in _built:
        out = tmp_path_factory.mktemp("vllm") / "ds"
        env = {**EAGER, "DATAGEN_STEP_TRACE": str(out.parent / "steps.json")}
        proc = run_datagen(*extract_args(tiny_llama, llama_rows(tmp_path_factory), out), env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        _built["vllm"] = (out, result_of(proc))
    return _built["vllm"]
