"""The env check's records: a check's status, its line of the report, and the report."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from datagen.engines.accelerators import Accelerators


class Status(str, enum.Enum):
    OK = "ok"
    FAILED = "failed"  # permanent: the spec cannot run here; ``fix`` says what to change
    UNKNOWN = "unknown"  # could not tell (network, storage): retry
    SKIPPED = "skipped"  # does not apply to this spec


class Check(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str = Field(description="What was checked, e.g. 'tensor_parallel', 'storage.output'.")
    status: Status
    detail: str = Field(description="What was found.")
    fix: str | None = Field(None, description="What to do, for a failed or unknown check.")


class EnvReport(BaseModel):
    """The env-check report (the step's result, and its JSON artifact)."""

    model_config = ConfigDict(frozen=True)

    ok: bool = Field(description="True when every check is ok or skipped.")
    checks: list[Check]
    accelerators: Accelerators
    model: dict = Field(description="architecture, num_hidden_layers, hidden_size, layer_ids, bytes.")
    estimate: dict = Field(description="Bytes the run needs: model cache and output.")
    engine: dict = Field(default_factory=dict, description="vLLM: the capture path and model runner a run "
                         "takes on the installed vLLM (capture_path, model_runner, why, public_path self-test).")
    seconds: float


def size_text(n: float) -> str:
    """A byte count as the report writes it (GB from 1e9 bytes, else MB)."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
