"""`datagen report DATASET [--previous ...]`: the plot written locally, drift found by validation's rule."""

from __future__ import annotations

import json

import pytest

from datagen import cli
from datagen.errors import EXIT_BAD_INPUT
from datagen.validation import layer_report
from tests.support.synthetic_shards import make_synthetic_dataset, manifest_of, write_manifest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def result(capsys) -> dict:
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(cli.RESULT_PREFIX)][-1]
    return json.loads(line.removeprefix(cli.RESULT_PREFIX))


@pytest.fixture
def nights(tmp_path):
    return [make_synthetic_dataset(tmp_path / f"night{i}", rows=16, seed=0) for i in range(3)]


def test_the_plot_of_runs_without_drift_is_written(nights, tmp_path, capsys):
    out = tmp_path / "plots" / "nightly.png"
    assert cli.main(["report", str(nights[2]), "--previous", str(nights[0]), str(nights[1]), "--out", str(out)]) == 0

    got = result(capsys)
    assert got["runs"] == 3 and got["drifted_layers"] == []
    assert set(got["layers"]) == {"1", "2", "3", "4"}
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_a_layer_beyond_the_threshold_is_named_and_drawn_differently(nights, tmp_path, capsys):
    m = manifest_of(nights[2])
    for s in m["layer_stats"]:
        if s["layer_id"] == 2:
            s["std"] *= 1.4  # beyond the 25% default
    write_manifest(nights[2], m)
    calm, marked = tmp_path / "calm.png", tmp_path / "marked.png"

    assert cli.main(["report", str(nights[1]), "--previous", str(nights[0]), "--out", str(calm)]) == 0
    assert result(capsys)["drifted_layers"] == []
    assert cli.main(["report", str(nights[2]), "--previous", str(nights[1]), "--out", str(marked)]) == 0
    got = result(capsys)
    assert got["drifted_layers"] == [2]
    assert got["layers"]["2"]["std_ratio"] == pytest.approx(1.4, rel=1e-3)
    assert got["layers"]["1"]["std_ratio"] == pytest.approx(1.0)
    assert marked.read_bytes() != calm.read_bytes()
    # a looser threshold lets it pass
    assert layer_report.make_report(nights[2], previous=[str(nights[1])], out=tmp_path / "loose.png", threshold=0.5)[
        "drifted_layers"] == []


def test_one_run_alone_is_plotted_without_a_drift_verdict(nights, tmp_path):
    got = layer_report.make_report(nights[0], out=tmp_path / "one.png")
    assert got["runs"] == 1 and got["drifted_layers"] == [] and got["layers"] == {}


def test_bad_input_is_refused_and_nothing_is_written(nights, tmp_path, capsys):
    assert cli.main(["report", str(nights[0]), "--out", str(tmp_path / "plot.svg")]) == EXIT_BAD_INPUT
    assert cli.main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "p.png")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert ".png" in err and "manifest.json" in err
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("*.svg"))
