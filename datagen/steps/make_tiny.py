"""The make-tiny step: ``datagen make-tiny``, a tiny random-weight model, its tokenizer and a chat
dataset (nothing downloaded). The generators are in ``datagen.models``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from datagen.testmodels.tiny import TinyArch, make_chat_dataset, make_model
from datagen.steps._args import StepSpec

HELP = "Make a tiny random-weight model, a tokenizer and a chat dataset (nothing downloaded)."


class Spec(StepSpec):
    out: str = Field(description="directory to create")
    arch: TinyArch = Field(TinyArch.DEEPSEEK_V3, description="architecture of the random-weight model")
    layers: int = Field(8, description="num_hidden_layers")
    rows: int = Field(64, description="rows of the chat dataset")
    seed: int = Field(0, description="seed of the weights and of the dataset's rows")
    kimi: Literal["int4", "none"] | None = Field(
        None, description="a tiny Kimi-K2.5 checkpoint instead (datagen.testmodels.tiny_kimi: the wrapper, INT4 experts "
        "or bf16, a bf16 DeepseekV3 twin in model-bf16) with a Kimi-shaped tiktoken tokenizer")


class MakeTinyResult(BaseModel):
    """What `datagen make-tiny` made."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(description="The model directory.")
    twin: Annotated[str | None, Field(exclude_if=lambda v: v is None)] = Field(
        None, description="The bf16 DeepseekV3 twin of a tiny Kimi checkpoint (--kimi only).")
    dataset: str = Field(description="The chat dataset (JSONL).")


Result = MakeTinyResult


def run(spec: Spec) -> MakeTinyResult:
    out = Path(spec.out)
    if spec.kimi:
        from datagen.testmodels.tiny_kimi import make_tiny_kimi
        from datagen.testmodels.tiny_tiktoken import write_kimi_tokenizer

        vocab = 2048
        paths = make_tiny_kimi(out / "model", quantization=spec.kimi, vocab_size=vocab, num_layers=spec.layers,
                               seed=spec.seed)
        write_kimi_tokenizer(paths.model, vocab_size=vocab)
        data = make_chat_dataset(out / "chat.jsonl", rows=spec.rows, seed=spec.seed)
        return MakeTinyResult(model=str(paths.model), twin=str(paths.twin), dataset=str(data))
    model_dir = make_model(out / "model", arch=spec.arch, num_layers=spec.layers, seed=spec.seed)
    data = make_chat_dataset(out / "chat.jsonl", rows=spec.rows, seed=spec.seed)
    return MakeTinyResult(model=str(model_dir), dataset=str(data))
