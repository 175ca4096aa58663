"""The one way datagen starts ``vllm.LLM``: the arguments every engine shares, and what a failed
start means for the user, the same from the extraction engine, the regeneration generator and the
engine-side golden reference."""

from __future__ import annotations

import pytest

from datagen.engines import vllm_llm
from datagen.errors import EngineSettingError, ModelError
from datagen.regeneration.generator import Generator
from datagen.regeneration.settings import RegenerationSettings

V2_REFUSED = "Model Runner V2 needs Triton, which this platform lacks (unset VLLM_USE_V2_MODEL_RUNNER)"


@pytest.fixture(autouse=True)
def _heap_unfrozen():
    """A stand-in ``LLM`` that starts leaves the heap frozen (a real engine's shutdown unfreezes it):
    each test starts and ends with this process's heap as Python leaves it."""
    import gc

    gc.unfreeze()
    yield
    gc.unfreeze()


def _refusing_llm(error: Exception):
    class RefusingLLM:
        def __init__(self, **kwargs):
            raise error

    return RefusingLLM


def test_a_refused_vllm_variable_is_named_with_vllms_reason(monkeypatch):
    import vllm

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr(vllm, "LLM", _refusing_llm(ValueError(V2_REFUSED)))
    with pytest.raises(EngineSettingError, match="refuses the setting VLLM_USE_V2_MODEL_RUNNER=1: Model Runner V2") as e:
        vllm_llm.start_llm({"model": "/m", "dtype": "float32"}, version="0.32.0")
    assert isinstance(e.value.__cause__, ValueError)


def test_a_refused_engine_option_is_named_with_its_value():
    err = vllm_llm.start_error(ValueError("max_model_len 4096 exceeds the model's 2048"), model="/m",
                               version="0.32.0", kwargs={"model": "/m", "max_model_len": 4096}, environ={})
    assert isinstance(err, EngineSettingError)
    assert "refuses the setting max_model_len=4096" in str(err)


def test_a_failure_that_names_no_setting_is_the_model_vllm_cannot_load(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", _refusing_llm(OSError("config.json not found")))
    with pytest.raises(ModelError, match="cannot load /m: config.json not found"):
        vllm_llm.start_llm({"model": "/m"}, version="0.32.0")


def test_the_engine_starts_with_this_processs_heap_frozen_and_a_failed_start_leaves_it_unfrozen(monkeypatch):
    # vLLM's seven collections while it starts skip what this process held before (its imports)
    import gc

    import vllm

    seen = []

    class CountingLLM:
        def __init__(self, **kwargs):
            seen.append(gc.get_freeze_count())

    monkeypatch.setattr(vllm, "LLM", CountingLLM)
    assert gc.get_freeze_count() == 0  # the fixture's
    vllm_llm.start_llm({"model": "/m"}, version="0.32.0")
    assert seen and seen[0] > 10_000, seen  # the imports' objects, frozen before LLM starts
    gc.unfreeze()  # a started engine's shutdown does this (vLLM's EngineCore.shutdown)

    for error in (OSError("config.json not found"), RuntimeError("an engine core died")):
        monkeypatch.setattr(vllm, "LLM", _refusing_llm(error))
        with pytest.raises((ModelError, RuntimeError)):
            vllm_llm.start_llm({"model": "/m"}, version="0.32.0")
        assert gc.get_freeze_count() == 0, f"left frozen after {error!r}"


def test_regeneration_starts_with_the_shared_arguments_plus_its_own(monkeypatch):
    import vllm

    started = {}

    class RecordingLLM:
        def __init__(self, **kwargs):
            started.update(kwargs)

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr("datagen.engines.vllm_devices.check_devices", lambda tp: False)
    monkeypatch.setattr("datagen.engines.vllm_devices.set_process_env", lambda **kw: None)
    gen = Generator("/m", RegenerationSettings(), max_model_len=64, stop_ids=[2], attention_backend="CPU_ATTN")
    gen.start()
    s = gen.settings
    shared = vllm_llm.llm_kwargs("/m", skip_tokenizer_init=True, dtype=s.dtype,
                                 tensor_parallel_size=s.tensor_parallel_size, max_model_len=64,
                                 max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                                 trust_remote_code=s.trust_remote_code, attention_backend="CPU_ATTN")
    assert started == {**shared, "enable_prefix_caching": True}
    assert shared["attention_config"] == {"backend": "CPU_ATTN"} and shared["seed"] == 0


def _reference(monkeypatch, llm):
    """The engine-side golden reference of a 4-layer model, started on ``llm`` (a stand-in for vllm.LLM)."""
    import vllm

    from datagen.engines.vllm_reference import VllmReference

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the reference sets it where unset
    monkeypatch.setattr(vllm, "LLM", llm)
    return VllmReference("/m", num_hidden_layers=4, wanted=(1, 4), dtype="float32", max_seq_len=63)


def test_the_golden_reference_starts_with_the_shared_arguments_plus_its_own(monkeypatch):
    from datagen.engines.vllm_reference import EXTENSION

    started = {}

    class RecordingLLM:
        def __init__(self, **kwargs):
            started.update(kwargs)

        def collective_rpc(self, method, args=()):
            return [len(args[1])]

    _reference(monkeypatch, RecordingLLM)
    shared = vllm_llm.llm_kwargs("/m", skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=1,
                                 max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64,
                                 trust_remote_code=False, attention_backend=None)
    assert started == {**shared, "enforce_eager": True, "enable_prefix_caching": False,
                       "enable_chunked_prefill": False, "worker_extension_cls": EXTENSION}


def test_a_setting_the_golden_reference_is_refused_reads_as_from_the_other_engines(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(EngineSettingError, match="refuses the setting VLLM_USE_V2_MODEL_RUNNER=1: Model Runner V2"):
        _reference(monkeypatch, _refusing_llm(ValueError(V2_REFUSED)))
