"""The `train` flow: what runs when `datagen.dataset.ready` announces a new dataset.

    deployment train/train (prefect.yaml), triggered by the event; or by hand:
    prefect deployment run train/train --param dataset=/path/to/dataset --param fingerprint=...

The handoff proves the data: an EAGLE-3 draft is trained on the dataset with speculators' own
trainer, straight from the packed shards (`datagen train`, the train image, on the deployment's
pool: GPUs in production, the CPU miniature in tests), written in the format vLLM loads as an
EAGLE-3 speculator next to the dataset (``<dataset>.draft-<fingerprint[:12]>``), and measured on
the dataset's held-out rows (`datagen measure-draft`: the draft is fed the target's own states of
the layers its config names, as vLLM feeds it, so a dataset of mislabelled layers makes a bad
draft, and the stored states are compared with the target's). The night's agreement is a Prefect artifact
with the plot of the last nights (``draft-report``), `datagen.draft.ready` announces the draft,
and a fall of the acceptance length beyond ``drop_threshold`` against the night before fails the
run with a message that names the dataset.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from datagen.training.nightly import DEFAULT_DROP_THRESHOLD
from tasks.measure_draft import measure_draft
from tasks.pipeline_spec import Runner
from tasks.train import (
    announce_draft,
    check_drop,
    check_features,
    draft_report,
    pool_device,
    settings_for,
    train_cache_key,
    train_draft,
)

# feature_error (median over the held-out tokens, per layer) above which the dataset's layers are wrong:
# measured, a right dataset 0.15-0.16% (bf16) and 2.0-2.3% (fp8, p99 2.9%), off-by-one layers 21-59%
DEFAULT_FEATURE_THRESHOLD = 0.10


@flow(name="train", description="Train an EAGLE-3 draft on a newly announced dataset and measure it.")
def train(dataset: str, fingerprint: str, model: str | None = None, runner: Runner = Runner.LOCAL,
          settings: dict | None = None, acceptance: str = "agreement",
          drop_threshold: float = DEFAULT_DROP_THRESHOLD, feature_threshold: float = DEFAULT_FEATURE_THRESHOLD,
          device: str | None = None) -> dict:
    """``dataset``: the announced dataset (a directory or s3:// URI); ``fingerprint``: its identity (the
    event's resource); ``model``: the target model directory (default: the one the manifest names);
    ``settings``: ``datagen.training.settings.DraftSettings`` fields: speculators' options by their names
    (unset: speculators' defaults for the installed release) and datagen's own (default: the pool's);
    ``acceptance``: ``agreement`` or ``vllm`` (also vLLM's speculative decoding, `datagen measure-draft`);
    ``device``: where the draft trains (default: the work pool's, ``cuda`` on a GPU pool, in the CUDA train
    image); ``feature_threshold``: the dataset's stored states further than this from the target's fail the run."""
    logger = get_run_logger()
    device = device or pool_device()
    settings = settings_for(settings, device=device)
    out = f"{dataset.rstrip('/')}.draft-{fingerprint[:12]}" if not dataset.startswith("s3://") else \
        f"drafts/{fingerprint[:12]}"
    trained = train_draft(dataset, out, model=model, settings=settings,
                          cache_key=train_cache_key(fingerprint=fingerprint, settings=settings, out=out), runner=runner)
    measured = measure_draft(trained.draft, dataset, model=model, acceptance=acceptance, runner=runner,
                             device=settings["device"])
    report = draft_report(measured, dataset=dataset, threshold=drop_threshold)
    announce_draft(trained, measured, dataset=dataset)
    logger.info("draft %s: agreement %s, acceptance length %.3f", trained.draft,
                " ".join(f"{p.agreement:.3f}" for p in measured.positions), measured.acceptance_length)
    check_features(measured, dataset=dataset, threshold=feature_threshold)
    check_drop(report, dataset=dataset, threshold=drop_threshold)
    return {"dataset": dataset, "fingerprint": fingerprint, "draft": trained.draft,
            "acceptance_length": measured.acceptance_length,
            "agreement": [p.agreement for p in measured.positions],
            "spec_decode_acceptance": measured.spec_decode.acceptance_length if measured.spec_decode else None}
