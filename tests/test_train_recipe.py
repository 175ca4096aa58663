"""`datagen train` trains speculators' own recipe: every option of speculators' training script is offered
(or is datagen's own, or refused with a reason), what is not given is speculators' default for the
installed release, and the draft and the optimizer are the ones speculators' script builds for the same
arguments (its ``main`` run for real on `datagen export --format speculators`, stopped where training
would start)."""

from __future__ import annotations

import json

import pytest
import torch

from datagen import cli
from datagen.steps.train import Spec
from datagen.training import recipe
from datagen.training.draft import LINEAGE_NAME, read_lineage
from tests.support.extracted import extracted_dataset

# the arguments both sides are given (speculators' flags); the CPU's attention and loss, as datagen sets them
COMMON = {"total_seq_len": 256, "ttt_steps": 2}
RECIPES = {
    "speculators' default": [],
    "adamw without the norms": ["--optimizer", "adamw", "--no-norm-before-fc", "--no-norm-output"],
}


class _Stop(Exception):
    """Raised where the first training step would start."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from datagen.export.speculators import export

    dataset = extracted_dataset(tmp_path_factory)
    out = tmp_path_factory.mktemp("recipe") / "export"
    export(dataset, out)
    return dataset, out


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _built(monkeypatch, run) -> object:
    """The ``Trainer`` that ``run()`` builds (speculators' or datagen's, on the CPU), stopped before its
    first step: its model, optimizers and schedulers as they are when training would start."""
    from speculators.train.trainer import Trainer

    built = []
    setup_model = Trainer.setup_model

    def on_cpu(self):  # speculators' Trainer moves the model to GPU index local_rank
        self.local_rank, self.device_type = "cpu", "cpu"
        setup_model(self)

    def stop(self, *args, **kwargs):
        built.append(self)
        raise _Stop

    monkeypatch.setattr(Trainer, "setup_model", on_cpu)
    monkeypatch.setattr(Trainer, "train_epoch", stop)
    monkeypatch.setattr(Trainer, "run_training", stop)
    with pytest.raises(_Stop):
        run()
    assert len(built) == 1
    return built[0]


def _speculators_script(dataset, export, model, save, flags: list[str]):
    """speculators' own training script (its argument resolution and ``main``) on the export."""
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    layers = json.loads((dataset / "manifest.json").read_text())["spec"]["layer_ids"][:-1]
    argv = ["--verifier-name-or-path", str(model), "--data-path", str(export), "--save-path", str(save),
            "--max-steps", "4", "--train-data-ratio", "0.75", "--num-workers", "0", "--logger", "",
            "--target-layer-ids", *map(str, layers), "--no-resume-from-checkpoint",
            *[x for dest, v in {**COMMON, **recipe.cpu_defaults()}.items() for x in (_flag(dest), str(v))], *flags]
    return lambda: main(TrainConfig.resolve(argv))


def _optimizers(trainer) -> list:
    return [(type(o).__name__, [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups])
            for o in trainer.optimizers]


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_draft_and_the_optimizer_are_the_ones_speculators_script_builds(name, exported, tmp_path, monkeypatch):
    dataset, export = exported
    # speculators' own defaults on any CPU (on one without bf16 kernels the CPU's defaults take AdamW)
    monkeypatch.setattr(recipe, "cpu_has_bf16", lambda: True)
    model = dataset.parent / "model"
    flags = RECIPES[name]
    theirs = _built(monkeypatch, _speculators_script(dataset, export, model, tmp_path / "theirs", flags))
    argv = ["train", str(dataset), "--out", str(tmp_path / "ours"), "--model", str(model), "--steps", "4",
            "--train-ratio", "0.75", *[x for dest, v in COMMON.items() for x in (_flag(dest), str(v))], *flags]
    ours = _built(monkeypatch, lambda: cli.main(argv))

    # the draft: its modules, parameters (the same seed: the same initial weights) and config
    a, b = theirs.model, ours.model
    assert [(n, type(m).__name__) for n, m in a.named_modules()] == [(n, type(m).__name__) for n, m in b.named_modules()]
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert {n: p.requires_grad for n, p in a.named_parameters()} == {n: p.requires_grad for n, p in b.named_parameters()}
    assert a.config.to_dict() == b.config.to_dict()
    norms = flags == []  # speculators' eagle3 default: both norms on
    assert (a.config.norm_before_fc, a.config.norm_output) == (norms, norms)
    # the optimizer: its classes, param groups (the parameters by name) and hyper-parameters, and the schedules
    assert _optimizers(theirs) == _optimizers(ours)
    assert [type(o).__name__ for o in ours.optimizers] == (["Muon", "AdamW"] if norms else ["AdamW"])
    lrs = [[s.lr_lambdas[0](k) for k in range(8)] for t in (theirs, ours) for s in t.schedulers]
    assert lrs[:len(lrs) // 2] == lrs[len(lrs) // 2:]
    # the rest of its TrainerConfig (the epochs aside: datagen runs epochs until --steps are done)
    differ = {"save_path", "num_epochs"}
    assert {k: v for k, v in theirs.config._asdict().items() if k not in differ} == \
        {k: v for k, v in ours.config._asdict().items() if k not in differ}


def test_a_trained_drafts_report_holds_the_recipe_as_speculators_resolved_it(exported, tmp_path):
    from speculators.train.config import TrainConfig

    dataset, _ = exported
    argv = ["train", str(dataset), "--out", str(tmp_path / "d"), "--model", str(dataset.parent / "model"),
            "--steps", "1", "--total-seq-len", "256", "--optimizer", "adamw", "--no-norm-output", "--lr", "2e-3"]
    assert cli.main(argv) == 0
    lineage = read_lineage(tmp_path / "d")
    assert (tmp_path / "d" / LINEAGE_NAME).exists()
    assert set(lineage.given) == {"total_seq_len", "optimizer", "norm_output", "lr"}
    assert set(lineage.device_defaults) == set(recipe.cpu_defaults()) - set(lineage.given)
    s = lineage.settings
    assert (s.optimizer, s.norm_output, s.lr, s.total_seq_len) == ("adamw", False, 2e-3, 256)
    # what was not given is speculators' default, resolved by speculators (norm_before_fc from eagle3, muon_lr
    # from lr) for the installed release
    default = TrainConfig.from_sources(cli={"verifier_name_or_path": "x", "lr": 2e-3}, argv=[]).flatten()
    unset = set(recipe.OFFERED) - set(lineage.given) - set(lineage.device_defaults)
    assert {d: getattr(s, d) for d in unset} == {d: default[d] for d in unset}
    assert s.norm_before_fc is True and s.muon_lr == 2e-3


@pytest.mark.parametrize("bf16_kernels", [True, False])
def test_a_cpu_without_bf16_kernels_trains_in_float32_unless_told_otherwise(bf16_kernels, exported, tmp_path,
                                                                          monkeypatch):
    """Where the CPU has no bf16 kernels (the check is faked here: the suite cannot pick its CPU), the states
    are read and the draft computes in float32, and AdamW steps it (torch's Muon computes in bf16): device
    defaults like the CPU's attention; given, the option wins."""
    dataset, _ = exported
    monkeypatch.setattr(recipe, "cpu_has_bf16", lambda: bf16_kernels)
    seen: set[torch.dtype] = set()

    def record(module, args):  # what each of the draft's modules is fed (the norms: the states as read)
        if args and torch.is_tensor(args[0]) and args[0].is_floating_point():
            seen.add(args[0].dtype)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        argv = ["train", str(dataset), "--out", str(tmp_path / "d"), "--model", str(dataset.parent / "model"),
                "--steps", "1", "--total-seq-len", "256"]
        assert cli.main(argv) == 0
    finally:
        handle.remove()
    lineage = read_lineage(tmp_path / "d")
    want = "bfloat16" if bf16_kernels else "float32"
    assert lineage.settings.hidden_states_dtype == want
    assert ("hidden_states_dtype" in lineage.device_defaults) == (not bf16_kernels)
    assert lineage.settings.optimizer == ("muon" if bf16_kernels else "adamw")  # torch's Muon computes in bf16
    assert ("optimizer" in lineage.device_defaults) == (not bf16_kernels)
    assert getattr(torch, want) in seen
    assert (torch.bfloat16 in seen) == bf16_kernels
    # given, it is the caller's: not a device default
    argv = ["train", str(dataset), "--out", str(tmp_path / "g"), "--model", str(dataset.parent / "model"),
            "--steps", "0", "--hidden-states-dtype", "bfloat16", "--optimizer", "muon"]
    assert cli.main(argv) == 0
    lineage = read_lineage(tmp_path / "g")
    assert lineage.settings.hidden_states_dtype == "bfloat16" and "hidden_states_dtype" in lineage.given
    assert lineage.settings.optimizer == "muon" and not {"hidden_states_dtype", "optimizer"} & set(lineage.device_defaults)


def test_every_option_of_speculators_script_is_offered_or_datagens_own_or_refused_with_a_reason():
    from speculators.train.config.schema import CONFIG_DESTS

    assert set(recipe.OWN) <= CONFIG_DESTS and set(recipe.NOT_OFFERED) <= CONFIG_DESTS  # none stale
    assert set(recipe.OWN.values()) <= set(Spec.model_fields)
    groups = {g for g, _ in recipe.SCHEMA.values()}
    assert set(recipe.NOT_OFFERED_GROUPS) <= groups
    accounted = set(recipe.OFFERED) | set(recipe.OWN) | set(recipe.NOT_OFFERED) | \
        {d for d, (g, _) in recipe.SCHEMA.items() if g in recipe.NOT_OFFERED_GROUPS}
    assert accounted == CONFIG_DESTS
    # each offered option is a flag of `datagen train`, named as speculators' script names it
    parser = cli.build_parser(only="train")
    sub = next(a for a in parser._actions if a.dest == "command").choices["train"]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {_flag(d) for d in recipe.OFFERED} <= flags
    assert {"--no-norm-before-fc", "--no-norm-output", "--optimizer"} <= flags
    args = parser.parse_args(["train", "ds", "--out", "d", "--no-norm-before-fc", "--optimizer", "adamw"])
    spec = cli.spec_from_namespace("train", Spec, args)
    assert (spec.norm_before_fc, spec.norm_output, spec.optimizer) == (False, None, "adamw")


def test_options_speculators_refuses_are_refused_before_a_model_is_loaded(exported, tmp_path, capsys):
    dataset, _ = exported
    code = cli.main(["train", str(dataset), "--out", str(tmp_path / "d"), "--model", str(dataset.parent / "model"),
                     "--steps", "1", "--hidden-states-dtype", "float16"])
    err = capsys.readouterr().err
    assert code == 2 and "speculators refuses" in err and "float16" in err
    assert not (tmp_path / "d").exists()
