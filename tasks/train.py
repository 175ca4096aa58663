"""The training tasks: train an EAGLE-3 draft on an announced dataset, measure it, report the night.

``train`` is the step task (``tasks/step.py``) under the step's name: `datagen train DATASET --out
DRAFT --model MODEL ...` (cached on the dataset's fingerprint, the settings and the draft directory:
one draft per dataset and settings). Its result is the step's own, ``TrainResult``. The draft is
measured by ``tasks/measure_draft.py``.

``draft_report`` attaches the night's agreement (a table and a plot of the last nights, next to the
layer report) and records this night's figures for the next; ``announce_draft`` emits
``datagen.draft.ready`` with the recipe the draft was trained with (every speculators option as
speculators resolved it, and which were given). ``check_drop`` fails the run, naming the dataset, when the acceptance
length fell beyond the threshold against the night before.
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event

from tasks.artifacts import table_history
from tasks.cache_keys import cache_key
from tasks.mounts import mounts_for
from tasks.pipeline_spec import Runner
from tasks.step import STEP_CACHE, StepCall, step_task

if TYPE_CHECKING:
    from datagen.steps.measure_draft import MeasureResult
    from datagen.steps.train import TrainResult
    from datagen.training.nightly import NightMeasurement

EVENT_DRAFT_READY = "datagen.draft.ready"
DRAFT_RESOURCE_PREFIX = "datagen.draft."
NIGHTS_KEY_PREFIX = "draft-agreement"
REPORT_NIGHTS = 8  # nights on the plot: this one and up to 7 before it


# Work pools whose workers have GPUs: a flow run on one trains there, in the CUDA train image.
GPU_POOLS = frozenset({"gpu"})
# On the GPU, the shards are read by DataLoader workers (one process cannot feed the trainer at 8B width:
# bench/gpu/results/train, docs/gpu.md), and the loss is speculators' eager one: its default, the fused Triton
# kernel, failed in its backward on the H200 image's torch 2.11 / Triton 3.6, in speculators' own script too
# (docs/gpu.md). Everything else is speculators' default recipe (datagen.training.recipe).
GPU_SETTINGS = {"loader_workers": 8, "loss_implementation": "eager"}


class AcceptanceDropped(RuntimeError):
    """The draft of tonight's dataset accepts fewer tokens per step than last night's, beyond the threshold."""


class FeaturesMismatch(RuntimeError):
    """The dataset's stored states of a layer are not the target's states of the layer they are labelled as."""


def pool_device(pool: str | None = None) -> str:
    """Where a flow run trains: the host's own ``DATAGEN_TRAIN_DEVICE`` (``cpu`` or ``cuda``) when its
    worker sets it, else ``cuda`` on a GPU work pool (``GPU_POOLS``) and ``cpu`` on any other. ``pool``:
    the work pool's name; None: the current flow run's."""
    from datagen.training.settings import Device

    declared = os.environ.get("DATAGEN_TRAIN_DEVICE", "").strip()
    if declared:
        if declared not in {d.value for d in Device}:
            raise ValueError(f"DATAGEN_TRAIN_DEVICE={declared!r}: a host trains on 'cpu' or 'cuda'; "
                             "set one of them in the worker's environment, or unset it to let the pool decide")
        return declared
    if pool is None:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        pool = ctx.flow_run.work_pool_name if ctx and ctx.flow_run else None
    return "cuda" if pool in GPU_POOLS else "cpu"


def settings_for(settings: dict | None, *, device: str) -> dict:
    """The draft settings a run trains with: the pool's device and, on a GPU, ``GPU_SETTINGS``; what the
    caller gives wins."""
    given = dict(settings or {})
    base = GPU_SETTINGS if given.get("device", device) == "cuda" else {}
    return {**base, "device": device, **given}


def train_cache_key(*, fingerprint: str, settings: dict, out: str) -> str:
    return cache_key("train", fingerprint, json.dumps(settings, sort_keys=True), out)


train_step = step_task("train", cache_policy=STEP_CACHE)


def train_draft(dataset: str, out: str, *, model: str | None, settings: dict, cache_key: str,
                runner: Runner) -> TrainResult:  # on a GPU (the CUDA train image) when settings' device is cuda
    """`datagen train` of ``dataset`` into ``out`` with ``settings`` (``DraftSettings`` fields); without a
    model, the step takes the one the dataset's manifest names."""
    from datagen.steps.train import Spec

    spec = Spec(dataset=dataset, out=out, model=model, **settings)
    call = StepCall(step="train", spec=spec.model_dump(mode="json"),
                    mounts=mounts_for(Path(out).parent, read_only=(dataset, *([model] if model else []))),
                    known={"draft": out}, gpus=1 if spec.device.value == "cuda" else 0)
    return train_step(call, cache_key=cache_key, runner=runner)


def nights_key(flow_name: str | None, deployment_name: str | None) -> str:
    """Artifact key of a deployment's nightly draft figures (lowercase letters, digits and dashes)."""
    raw = f"{NIGHTS_KEY_PREFIX}-{flow_name or 'flow'}-{deployment_name or 'no-deployment'}".lower()
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw)).strip("-")


@task(name="draft-report")
def draft_report(measured: MeasureResult, *, dataset: str, threshold: float, nights: int = REPORT_NIGHTS) -> dict:
    """Attach tonight's agreement and the last nights' plot; record tonight for the next night.
    Returns ``{"dropped": bool, "fall": float | None}`` (the comparison with the night before)."""
    from prefect.runtime import deployment, flow_run

    from datagen.training.nightly import NightMeasurement, drop_of, markdown_table, plot

    key = nights_key(flow_run.flow_name, deployment.name)
    tonight = NightMeasurement(
        label=Path(dataset.rstrip("/")).name or dataset, dataset=dataset, fingerprint=measured.dataset_fingerprint,
        agreement=tuple(p.agreement for p in measured.positions), acceptance_length=measured.acceptance_length,
        spec_decode_acceptance=measured.spec_decode.acceptance_length if measured.spec_decode else None)
    shown = [NightMeasurement.from_rows(rows)
             for rows in table_history(key, nights - 1, exclude_flow_run=flow_run.id)] + [tonight]
    drop = drop_of(shown, threshold=threshold)
    png = plot(shown, drop, title=f"{flow_run.flow_name}/{deployment.name or '-'}: draft on held-out rows")
    head = (f"# EAGLE-3 draft: acceptance DROP {drop.fall:.0%} on {dataset}" if drop and drop.failed
            else "# EAGLE-3 draft: agreement on the held-out rows")
    create_markdown_artifact(
        "\n".join([head, "", f"![agreement of the last nights](data:image/png;base64,{base64.b64encode(png).decode()})",
                   "", markdown_table(shown, drop)]),
        key="draft-report", description="The draft's per-position agreement and acceptance length, last nights.")
    create_table_artifact(tonight.to_rows(), key=key,
                          description="Tonight's draft figures (the next nights' report reads them).")
    return {"dropped": bool(drop and drop.failed), "fall": drop.fall if drop else None}


@task(name="announce-draft")
def announce_draft(trained: TrainResult, measured: MeasureResult, *, dataset: str) -> str:
    """Emit ``datagen.draft.ready`` for the draft. Returns the event's resource id."""
    resource_id = DRAFT_RESOURCE_PREFIX + trained.dataset_fingerprint
    emit_event(
        event=EVENT_DRAFT_READY,
        resource={"prefect.resource.id": resource_id, "prefect.resource.name": trained.draft,
                  "datagen.draft.uri": trained.draft},
        payload={"draft": trained.draft, "dataset": dataset, "fingerprint": trained.dataset_fingerprint,
                 "steps": trained.steps_done, "acceptance_length": measured.acceptance_length,
                 "agreement": [p.agreement for p in measured.positions],
                 "spec_decode_acceptance": measured.spec_decode.acceptance_length if measured.spec_decode else None,
                 "speculators_version": trained.speculators_version,
                 "recipe": trained.settings.model_dump(mode="json"), "recipe_given": trained.given},
    )
    get_run_logger().info("announced %s: %s", EVENT_DRAFT_READY, trained.draft)
    return resource_id


def check_drop(report: dict, *, dataset: str, threshold: float) -> None:
    """Raise ``AcceptanceDropped`` naming the dataset when tonight's draft fell beyond the threshold."""
    if report["dropped"]:
        raise AcceptanceDropped(
            f"the EAGLE-3 draft trained on {dataset} accepts {report['fall']:.1%} fewer tokens per step than the "
            f"night before (threshold {threshold:.0%}): look at this dataset's rows, layers and storage dtype "
            f"(the draft-report artifact shows the nights)")


def check_features(measured: MeasureResult, *, dataset: str, threshold: float) -> None:
    """Raise ``FeaturesMismatch`` naming the dataset and the layers whose stored states are further from
    the target's than ``threshold`` (median relative error over the held-out tokens). A right dataset
    is at its storage's rounding (bf16 0.2%, fp8 2.3%); off-by-one layers are 21% or more away, and
    agreement alone did not separate them (docs/training.md)."""
    bad = [e for e in measured.feature_error if e.median > threshold]
    if bad:
        raise FeaturesMismatch(
            f"the states stored in {dataset} are not the target's states of the layers they are labelled as: "
            + ", ".join(f"layer {e.layer} {e.median:.1%} away (p99 {e.p99:.1%})" for e in bad)
            + f" (threshold {threshold:.0%}): check the extraction's layer_ids against the capture (an off-by-one "
              f"layer list is tens of percent away)")
