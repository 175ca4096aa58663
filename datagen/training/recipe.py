"""speculators' training recipe, resolved by speculators for the installed release.

`datagen train` offers every option of speculators' training script (``speculators train``) that
applies to an EAGLE-3 draft trained from a dataset: one field per option of its config schema
(``speculators.train.config.schema.TrainConfig``), made here from that schema (its type and its
description), each ``None`` unless given. What is not given takes speculators' default, and speculators'
own resolution decides it (``TrainConfig.from_sources``: its defaults, the ones derived from others
such as ``norm_before_fc``/``norm_output`` for eagle3 and ``muon_lr`` from ``lr``, its validation), so
the defaults are those of the installed release and move with it. The draft is built by its script's
``build_draft_model`` and stepped by its ``Trainer`` (whose ``build_optimizers`` makes AdamW or Muon)
under a ``TrainerConfig`` filled from the resolved config as its script fills it.

The script's other options are datagen's own, under other names (``OWN``), or do not apply to training
from a finished dataset (``NOT_OFFERED``, each with the reason). Only the CPU departs from speculators'
defaults, where its kernels do not run (``CPU_DEFAULTS``) or its bf16 compute is slow
(``cpu_defaults``); the resolved values are written into the
draft's report (``datagen_draft.json``) and the step's result.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model
from speculators.train.config import TrainConfig

# the script's options that datagen gives under names of its own: speculators' dest -> datagen's field
OWN: Mapping[str, str] = MappingProxyType({
    "verifier_name_or_path": "model",
    "data_path": "dataset",
    "save_path": "out",
    "max_steps": "steps",
    "train_data_ratio": "train_ratio",
    "num_workers": "loader_workers",
})
# the script's options that do not apply to a draft trained from a finished dataset: dest -> why
NOT_OFFERED: Mapping[str, str] = MappingProxyType({
    "speculator_type": "datagen trains EAGLE-3 drafts (eagle3)",
    "dry_run": "`--steps 0` writes the untrained draft",
    "target_layer_ids": "the dataset's layers (its manifest) are the draft's",
    "hidden_states_backend": "the packed shards are read directly",
    "max_anchors": "DFlash-family and P-EAGLE drafts only",
    "epochs": "--steps: epochs run until the steps are done",
    "checkpoint_freq": "the draft is written once, at the end (no checkpoints)",
    "save_best": "the draft is written once, at the end (no validation pass)",
    "no_resume_from_checkpoint": "no checkpoints: a run always starts fresh",
    "fsdp_shard": "torchrun trains data-parallel (DDP); the draft is saved whole from rank 0",
})
# whole groups of the schema that do not apply, and why
NOT_OFFERED_GROUPS: Mapping[str, str] = MappingProxyType({
    "generation": "the hidden states come from the dataset, never generated on demand",
    "logging": "the losses go to the draft's report and the flow's artifacts",
    **{g: "other speculator types than eagle3" for g in ("dflash", "dflash2", "dspark", "xpress", "peagle", "mtp")},
})
# where the CPU cannot run speculators' default: its flex attention and fused loss are GPU (Triton) kernels
CPU_DEFAULTS: Mapping[str, Any] = MappingProxyType({"draft_attn_impl": "sdpa", "loss_implementation": "eager"})
# where the CPU has no bf16 kernels (no AVX-512 or AMX), bf16 is slow: a bf16 matmul of a draft's shapes took 7x
# the float32 one (427 against 62 ms on one thread of an AMD EPYC with AVX2 only), and torch's Muon orthogonalizes
# each update in bf16 whatever the run's dtype: at SmolLM2's draft shape a step took 48 s in bf16 with Muon, 1.4 s
# in float32 with AdamW (python -m bench.train_cpu). There the states are read and computed in float32, and AdamW
# steps every weight (the GPU proof measured its drafts as good as Muon's in vLLM: docs/performance.md 10h). Given,
# either option wins.
NO_BF16_DEFAULTS: Mapping[str, Any] = MappingProxyType({"hidden_states_dtype": "float32", "optimizer": "adamw"})


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 kernels (oneDNN's own check: AVX-512 or better)."""
    import torch

    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_defaults() -> Mapping[str, Any]:
    """The options a CPU draft takes unless given: ``CPU_DEFAULTS``, and ``NO_BF16_DEFAULTS`` where the
    CPU has no bf16 kernels."""
    return MappingProxyType({**CPU_DEFAULTS, **({} if cpu_has_bf16() else NO_BF16_DEFAULTS)})


def _schema_fields() -> dict[str, Any]:
    """speculators' config fields: dest -> (its group or None for a root field, its FieldInfo)."""
    out: dict[str, Any] = {}
    for name, field in TrainConfig.model_fields.items():
        group = field.annotation
        if isinstance(group, type) and issubclass(group, BaseModel):
            out.update({dest: (name, f) for dest, f in group.model_fields.items()})
        else:
            out[name] = (None, field)
    return out


SCHEMA = _schema_fields()
# the options offered (speculators' dest names, in its schema's order)
OFFERED: tuple[str, ...] = tuple(
    dest for dest, (group, _) in SCHEMA.items()
    if dest not in OWN and dest not in NOT_OFFERED and group not in NOT_OFFERED_GROUPS)


def _option(field) -> tuple[Any, Any]:
    # argparse formats help text with %: speculators' descriptions are plain text
    text = (field.description or "").replace("%", "%%")
    return field.annotation | None, Field(None, description=f"{text} (unset: speculators' default)")


# one field per offered option: its type and description are speculators'; unset (None) is its default
SpeculatorsOptions: type[BaseModel] = create_model(
    "SpeculatorsOptions", __config__=ConfigDict(extra="forbid", frozen=True),
    **{dest: _option(SCHEMA[dest][1]) for dest in OFFERED})


def default(dest: str) -> Any:
    """speculators' default of one option for an eagle3 draft, given nothing else."""
    return TrainConfig().flatten()[dest]


@dataclass(frozen=True)
class Recipe:
    """speculators' resolved config for one training run, and what of it was given."""

    config: TrainConfig  # speculators' own, resolved (defaults, derived defaults, validation)
    given: tuple[str, ...]  # the offered options set by the caller (the rest are speculators' defaults)
    device_defaults: tuple[str, ...]  # the offered options set by cpu_defaults()

    def flat(self) -> dict[str, Any]:
        """speculators' flat ``vars(args)`` (what its model classes and builders consume)."""
        return self.config.flatten()

    def args(self) -> argparse.Namespace:
        """A fresh namespace of the flat config, as its script hands to ``build_draft_model``."""
        return argparse.Namespace(**self.flat())

    def offered(self) -> dict[str, Any]:
        """The resolved value of every offered option (JSON-ready)."""
        flat = self.flat()
        return {dest: flat[dest] for dest in OFFERED}


def resolve(options: BaseModel, *, own: Mapping[str, Any], device_defaults: Mapping[str, Any]) -> Recipe:
    """speculators' config from the offered options given in ``options`` (unset: its defaults), datagen's
    own values (``own``: speculators' dest -> value) and ``device_defaults`` for options not given.

    Raises:
        ValueError: speculators refused the combination (its ``ConfigError`` or a field's validation).
    """
    given = {dest: getattr(options, dest) for dest in OFFERED if getattr(options, dest) is not None}
    filled = {dest: v for dest, v in device_defaults.items() if dest not in given}
    cli = {**filled, **given, **own, "speculator_type": "eagle3", "no_resume_from_checkpoint": True}
    config = TrainConfig.from_sources(cli=cli, argv=[])
    return Recipe(config=config, given=tuple(given), device_defaults=tuple(filled))


def trainer_config(recipe: Recipe, *, num_epochs: int, save_path: str):
    """speculators' ``TrainerConfig`` as its script fills it from the resolved config: the fields of the
    same name, and the five it renames or derives (epochs, save path, resume, the model class's call
    kwargs, the dtype)."""
    import torch
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.trainer import TrainerConfig

    flat = recipe.flat()
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(**flat)
    same = {k: flat[k] for k in TrainerConfig._fields if k in flat}
    return TrainerConfig(**{**same, "num_epochs": num_epochs, "save_path": save_path,
                            "resume_from_checkpoint": not flat["no_resume_from_checkpoint"],
                            "train_call_kwargs": train_kwargs, "val_call_kwargs": val_kwargs,
                            "hidden_states_dtype": getattr(torch, flat["hidden_states_dtype"])})


def build_draft(recipe: Recipe, *, t2d, d2t, draft_vocab_size: int):
    """The draft speculators' script builds for this config (``build_draft_model``: from the verifier's
    config, ``--draft-config`` or ``--from-pretrained``), seeded as its script seeds it."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary
    from speculators.train.cli import build_draft_model, set_seed

    args = recipe.args()
    set_seed(args.seed, args.deterministic_cuda)
    if not args.draft_mrope_full_head_hack:
        install_partial_neox_rotary()
    return build_draft_model(args, Eagle3DraftModel, t2d, d2t, draft_vocab_size)
