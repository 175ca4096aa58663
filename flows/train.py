"""The `train` flow: what runs when `datagen.dataset.ready` announces a new dataset.

    deployment train/train (prefect.yaml), triggered by the event; or by hand:
    prefect deployment run train/train --param dataset=/path/to/dataset --param fingerprint=...

It prepares the dataset for training (the speculators layout, next to the dataset) and logs where
the training job finds it. Training the EAGLE-3 draft model itself is the training team's job;
this is the hook it plugs into.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from tasks.pipeline_spec import Runner
from tasks.train_prep import export_cache_key, export_speculators


@flow(name="train", description="Prepare a newly announced dataset for EAGLE-3 draft training.")
def train(dataset: str, fingerprint: str, runner: Runner = Runner.LOCAL) -> dict:
    """``dataset``: the announced dataset (a local directory or an s3:// URI); ``fingerprint``: its
    identity (the event's resource)."""
    logger = get_run_logger()
    if dataset.startswith("s3://"):
        logger.info("dataset %s is in S3: the training job reads it there (fingerprint %s)", dataset, fingerprint)
        return {"dataset": dataset, "fingerprint": fingerprint, "speculators": None}
    out = f"{dataset.rstrip('/')}.speculators-{fingerprint[:12]}"
    exported = export_speculators(
        dataset, out, cache_key=export_cache_key(fingerprint=fingerprint, out=out), runner=runner
    )
    # None: an earlier export kept
    speculators = exported.out if exported is not None else (out if Path(out).exists() else None)
    logger.info("training data for %s: %s", fingerprint[:12], speculators or dataset)
    return {"dataset": dataset, "fingerprint": fingerprint, "speculators": speculators}
