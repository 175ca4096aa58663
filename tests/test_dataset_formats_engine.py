"""Each dataset format end to end on the CPU engine: `datagen extract`, `validate` and `export` of a
ShareGPT file, an UltraChat-style JSON array, a tool-calling chat with its tools, and a Hugging Face
dataset folder, the exported tokens and masks exact against an independent rendering of the
template, and the format recorded in the manifest."""

from __future__ import annotations

import json

import pytest

from tests.builders import result_of, run_datagen, write_jsonl
from tests.test_dataset_formats import CALL, WEATHER, independent_mask

pytestmark = pytest.mark.engine

TURNS = ["What is two plus two?", "Four.", "And three plus three?", "Six."]
SHAREGPT = [{"conversations": [{"from": "human" if j % 2 == 0 else "gpt", "value": t} for j, t in enumerate(TURNS)]},
            {"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}]
TOOLS = [{"tools": json.dumps([WEATHER]), "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "content": "{\"temp\": 18}"},
    {"role": "assistant", "content": "It is 18 degrees."}]}]


def _as_chat(row: dict) -> tuple[list[dict], list | None]:
    """What the row is, as messages and tools, written out by hand (not by the code under test)."""
    if "data" in row:
        return [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(row["data"])], None
    if "conversations" in row:
        msgs = [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
                for t in row["conversations"]]
        return ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + msgs, None
    msgs = [{**m, "content": m["content"] or ""} for m in row["messages"]]
    return msgs, json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools")


def _dataset(kind: str, root) -> tuple[str, list[dict], str]:
    if kind == "sharegpt":
        return str(write_jsonl(root / "sharegpt.jsonl", SHAREGPT)), SHAREGPT, "jsonl/sharegpt"
    if kind == "ultrachat":
        rows = [{"id": "1", "data": TURNS}, {"id": "2", "data": TURNS[:2]}]
        (root / "ultrachat.json").write_text(json.dumps(rows, indent=2))
        return str(root / "ultrachat.json"), rows, "json/ultrachat"
    if kind == "tools":
        return str(write_jsonl(root / "tools.jsonl", TOOLS)), TOOLS, "jsonl/messages"
    import datasets

    # (every row with a system column: from_list takes its columns from the first row; "" is no system prompt)
    table = [{"system": r.get("system", ""), "conversations": r["conversations"]} for r in SHAREGPT]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(table)}).save_to_disk(str(root / "hf"))
    return str(root / "hf"), SHAREGPT, "hf-disk/sharegpt"


@pytest.mark.parametrize("kind", ["sharegpt", "ultrachat", "tools", "hf"])
def test_each_format_extracts_validates_and_exports_with_exact_masks(kind, tiny_llama, tmp_path):
    import datasets
    from transformers import AutoTokenizer

    data, rows, fmt = _dataset(kind, tmp_path)
    out = tmp_path / "out"
    env = {"DATAGEN_ENFORCE_EAGER": "1"}
    proc = run_datagen("extract", "--model", str(tiny_llama), "--dataset", data, "--out", str(out),
                       "--max-seq-len", "512", "--samples-per-shard", "2", env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spec"]["dataset"]["format"] == fmt and manifest["spec"]["dataset"]["rows"] == len(rows)
    proc = run_datagen("validate", str(out), "--golden", "1", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = run_datagen("export", str(out), str(tmp_path / "export"), "--format", "speculators", env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result_of(proc)
    exported = datasets.load_from_disk(str(tmp_path / "export"))
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert len(exported) == len(rows)
    for row, sample in zip(rows, exported):
        ids, mask = independent_mask(tok, *_as_chat(row))
        assert list(sample["input_ids"]) == ids and list(sample["loss_mask"]) == mask
