"""The `datagen` command line made from the steps' Spec models: every option says what it is for,
and a step whose Spec is a domain model is read whole from ``--spec``, the options on top."""

from __future__ import annotations

import argparse
import json

import pytest

from datagen.cli import build_parser, spec_from_namespace
from datagen.errors import SpecError
from datagen.steps import STEPS, load


def _step_parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("step", list(STEPS))
def test_every_option_of_every_step_has_a_help_text(step):
    parser = _step_parsers()[step]
    silent = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
              if not (a.help or "").strip()]
    assert silent == [], f"`datagen {step}` options without help"


def test_the_extract_options_keep_their_names_and_say_what_they_are():
    help_text = _step_parsers()["extract"].format_help()
    for flag in ("--spec", "--model", "--model-revision", "--dataset", "--out", "--layers", "--max-seq-len",
                 "--samples-per-shard", "--engine", "--tensor-parallel-size", "--dtype", "--storage-dtype",
                 "--shard-group", "--max-num-batched-tokens", "--shards"):
        assert flag in help_text
    assert "Rows longer than this are truncated" in help_text  # --max-seq-len: the field's description


def _parse(step: str, *argv: str):
    parser = build_parser(only=step)
    args = parser.parse_args([step, *argv])
    return spec_from_namespace(step, load(step).Spec, args)


def test_the_spec_file_is_read_whole_and_the_options_override_it(tmp_path):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"model": "/m", "dataset": "/d.jsonl", "out": "/o", "samples_per_shard": 3,
                                     "engine": {"name": "hf", "max_num_seqs": 7}, "shards": [0, 2]}))
    spec = _parse("extract", "--spec", str(spec_file), "--dtype", "float32", "--layers", "1,3", "--shards", "1:2")
    assert (spec.model, spec.samples_per_shard, spec.layer_ids, spec.shards) == ("/m", 3, (1, 3), (1, 2))
    assert (spec.engine.name.value, spec.engine.max_num_seqs, spec.engine.dtype) == ("hf", 7, "float32")
    assert spec.plan is None  # a spec, planned by the step itself


def test_extract_and_assemble_take_a_plan_file_and_extract_refuses_what_the_plan_fixes(tmp_path):
    from tests.support.plan_records import plan_record

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan_record().model_dump_json())
    spec = _parse("extract", "--plan", str(plan_file), "--shards", "0:1", "--out", "/spool")
    assert (spec.plan, spec.shards, spec.out, spec.model) == (plan_record(), (0, 1), "/spool", None)
    assert _parse("assemble", "--plan", str(plan_file), "--records", "/r").plan == plan_record()
    with pytest.raises(SpecError, match="layer_ids given with --plan: the plan fixes them"):
        _parse("extract", "--plan", str(plan_file), "--layers", "1,2")
    with pytest.raises(SpecError, match="missing --model, --dataset, --out: give the spec to extract, or --plan"):
        _parse("extract", "--shards", "0:1")
    with pytest.raises(SpecError, match="cannot read the plan file"):
        _parse("extract", "--plan", str(tmp_path / "none.json"))


def test_plan_and_assemble_take_no_shard_range():
    assert "--shards" not in _step_parsers()["plan"].format_help()
    assert "--shards" not in _step_parsers()["assemble"].format_help()


def test_a_spec_without_its_required_fields_names_the_options(tmp_path):
    with pytest.raises(SpecError, match="missing --dataset, --out"):
        _parse("plan", "--model", "/m")


def test_a_step_that_cannot_be_imported_here_says_which_package_it_lacks(monkeypatch, capsys):
    """The image without a package a step needs: whatever options were given, the error names the
    missing package (not argparse's "unrecognized arguments"), and the exit code is not 0 or 2."""
    import datagen.cli as cli

    def missing(name):
        raise ModuleNotFoundError("No module named 'somepkg'", name="somepkg")

    monkeypatch.setattr(cli, "load", missing)
    code = cli.main(["plan", "--spec", "s.json", "--out", "o"])
    err = capsys.readouterr().err
    assert "needs the package somepkg" in err and "unrecognized" not in err
    assert code not in (0, 2)
    monkeypatch.undo()
    with pytest.raises(SystemExit) as e:  # an importable step still refuses what it does not take
        cli.main(["plan", "--no-such-option"])
    assert e.value.code == 2
