"""The calls a training run is made of, timed: what ``bench.train_startup`` and ``bench/gpu/train.py``
record in every `datagen train` and speculators' script run, to say where a run's start and end go."""

from __future__ import annotations

import time

# (module, attribute, phase): the calls timed; an attribute "Class.method" wraps the method on the class
SPANS = (
    ("datagen.training.draft", "resolve_settings", "recipe"),
    ("datagen.training.layers", "as_reader", "reader opened"),
    ("datagen.reader._dataset", "DatasetReader.verify_samples", "shards hashed"),
    ("datagen.training.draft", "build_draft", "draft built"),
    ("datagen.training.draft", "_loader", "loader"),
    ("datagen.training.draft", "_write", "draft saved"),
    ("speculators.train.config.schema", "TrainConfig.save", "run.yaml written"),
    ("speculators.train.cli", "parse_vocab_mappings", "vocabulary"),
    ("speculators.train.cli", "build_draft_model", "draft built"),
    ("speculators.train.cli", "create_train_val_loaders", "loader"),
    ("speculators.train.trainer", "Trainer.__init__", "trainer"),
    ("speculators.train.trainer", "Trainer.val_epoch", "validation pass"),
    ("speculators.train.trainer", "Trainer.maybe_save_checkpoint", "checkpoint"),
    ("speculators.train.trainer", "Trainer.maybe_update_best", "checkpoint"),
)


def install(marks: list) -> None:
    """Wrap every call of ``SPANS`` (``marks`` gets ``[phase, start, end]`` in epoch seconds) and record
    each training step's end (``["step", t, t]``) from speculators' metric records."""
    import functools
    import importlib
    import logging

    for module, attr, phase in SPANS:
        owner = importlib.import_module(module)
        *cls, name = attr.split(".")
        if cls:
            owner = getattr(owner, cls[0])
        real = getattr(owner, name)

        def timed(*a, _real=real, _phase=phase, **k):
            t = time.time()
            try:
                return _real(*a, **k)
            finally:
                marks.append([_phase, t, time.time()])

        setattr(owner, name, functools.wraps(real)(timed))

    class Steps(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict) and isinstance(record.msg.get("train"), dict):
                profile = {k: v for k, v in (record.msg.get("profile") or {}).items() if k.endswith("_ms")}
                marks.append(["step", record.created, record.created, profile])

    handler = Steps(logging.INFO)
    metrics = logging.getLogger("speculators.metrics")

    def attach() -> None:
        if handler not in metrics.handlers:
            metrics.addHandler(handler)
        metrics.setLevel(logging.INFO)

    import speculators.train.cli as spec_cli

    setup = spec_cli.setup_metric_logger

    def setup_and_attach(*a, **k):  # speculators' logging setup replaces the logger's handlers
        r = setup(*a, **k)
        attach()
        return r

    spec_cli.setup_metric_logger = setup_and_attach
    attach()


def cpu_shims() -> None:
    """speculators' Trainer on a machine without an accelerator (what `datagen train` does for itself)."""
    import torch
    from speculators.train.trainer import Trainer

    if torch.accelerator.current_accelerator() is not None:
        return
    setup_model = Trainer.setup_model

    def on_cpu(self):
        self.local_rank, self.device_type = "cpu", "cpu"
        setup_model(self)

    Trainer.setup_model = on_cpu
    torch.accelerator.synchronize = lambda *a, **k: None
