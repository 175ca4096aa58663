"""``vllm.LLM``, started the one way: the arguments every datagen engine sets alike, and what a
failed start means for the user.

The extraction engine (vllm_engine), the regeneration generator and the engine-side golden
reference (vllm_reference) each add the arguments that are theirs (capture, prefix caching,
chunking, eager hooks) to ``llm_kwargs`` and start through ``start_llm``, so a setting vLLM refuses
reads the same from any of them.
"""

from __future__ import annotations

import gc
import os
import re

from datagen import settings
from datagen.errors import EngineSettingError, ModelError


def llm_kwargs(model: str, *, skip_tokenizer_init: bool, dtype: str, tensor_parallel_size: int,
               max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, trust_remote_code: bool,
               attention_backend: str | None) -> dict:
    """The ``LLM`` arguments every engine sets: the model, its size and batch limits, the memory and
    eager settings of this process (datagen.settings), seed 0, and the attention backend when one is
    named (the CPU build's, chosen by vllm_attention.choose_attention_backend)."""
    kwargs = dict(
        model=model,
        skip_tokenizer_init=skip_tokenizer_init,
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        trust_remote_code=trust_remote_code,
        gpu_memory_utilization=settings.gpu_memory_utilization(),
        enforce_eager=settings.enforce_eager(),
        seed=0,
    )
    if attention_backend is not None:
        kwargs["attention_config"] = {"backend": attention_backend}
    return kwargs


def start_llm(kwargs: dict, *, version: str):
    """``vllm.LLM(**kwargs)``, started; a failure raised as what it means for the user (start_error).

    Raises:
        EngineSettingError: vLLM refuses a setting its reason names.
        ModelError: vLLM cannot load the model.
    """
    from vllm import LLM

    # vLLM collects the garbage seven times while it starts (parallel state, the model's load, its
    # runner, the heap it freezes): each full collection walks every object of this process, by then
    # hundreds of thousands from the imports of torch, vLLM and transformers, 2.2 s of CPU in all in
    # each start of a tiny model (cProfile). Frozen, those objects are skipped; they live as long as
    # the process anyway. vLLM freezes its own heap once started and unfreezes everything when the
    # engine shuts down; a start that fails unfreezes here.
    gc.freeze()
    try:
        return LLM(**kwargs)
    except (ValueError, OSError) as e:
        gc.unfreeze()
        raise start_error(e, model=kwargs["model"], version=version, kwargs=kwargs) from e
    except BaseException:
        gc.unfreeze()
        raise


# Words of a setting's name that say nothing of what it sets (VLLM_USE_V2_MODEL_RUNNER: "v2 model runner").
_NAME_FILLER = frozenset({"vllm", "use", "enable", "disable", "num", "max", "config"})


def _named_in(name: str, reason: str) -> bool:
    """Whether vLLM's reason names this setting: its name, or (for a name of two telling words or
    more) every telling word of it, as words."""
    words = set(re.findall(r"[a-z0-9]+", reason.lower().replace("_", " ")))
    if name.lower() in reason.lower():
        return True
    telling = [w for w in name.lower().split("_") if w and w not in _NAME_FILLER]
    return len(telling) >= 2 and all(w in words for w in telling)


def start_error(e: Exception, *, model, version: str, kwargs: dict, environ=None) -> ModelError | EngineSettingError:
    """What a failed ``LLM(...)`` means for the user: the setting vLLM refuses (an engine option or a
    ``VLLM_*`` variable whose name its reason names), with vLLM's reason; else the model it cannot
    load, with the engine settings in force to check.

    Args:
        e: what ``LLM(**kwargs)`` raised.
        model: the model directory.
        version: the vLLM release.
        kwargs: the engine options ``LLM`` was given.
        environ: the environment (default: this process's).
    """
    reason = str(e).strip() or type(e).__name__
    env = os.environ if environ is None else environ
    variables = {k: v for k, v in env.items() if k.startswith("VLLM_")}
    named = [f"{k}={v}" for k, v in sorted(variables.items()) if _named_in(k, reason)]
    named += [f"{k}={v!r}" for k, v in kwargs.items() if k != "model" and _named_in(k, reason)]
    if named:
        return EngineSettingError(
            f"vLLM {version} refuses the setting {', '.join(named)}: {reason}", settings=named,
            hint=f"change or unset {' and '.join(n.split('=')[0] for n in named)} (vLLM's reason says what it "
                 "needs); datagen sets what capture needs itself",
        )
    inforce = ", ".join(f"{k}={v}" for k, v in sorted(variables.items()))
    return ModelError(f"vLLM {version} cannot load {model}: {reason}",
                      hint="check the model files and the engine settings"
                           + (f" (VLLM_* variables set here: {inforce})" if inforce else ""))
