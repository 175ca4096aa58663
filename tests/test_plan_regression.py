"""The same inputs give the same dataset: fingerprints, shard keys, cache keys, manifests and shard bytes
as the code of main before the plan file (issue 59) gave, held against a fixture it wrote.

Two extractions of the tiny Llama (built at test time, seeded) with the transformers engine, each run as
the `extract` flow runs its steps (plan, the ranges, finalize) and assembled as a fanned-out run's
parent assembles it: one with rows per shard, the default layers and bf16; one with shards sized by
bytes, named layers and fp8 storage. ``tests/data/plan_regression.json`` is what main wrote at
a169639 (``python -m tests.test_plan_regression --write`` writes it again: only when a change of the
data is meant). The engines' versions are in the fingerprint: on other versions the test is skipped.

What the model's arithmetic decides (the shards' sha256 and the states' statistics) depends on the
CPU's kernels: a machine without AVX-512 rounds the tiny Llama's float32 states to other bf16 values.
So the fixture holds everything else once, and those values per kind of CPU (``cpu_kind``: the vendor
and the kernels torch picks); on a kind it does not hold, the shards and statistics are checked to
agree with each other (every manifest's sha256 is its file's, the assembled manifest is the
finalized one) and a warning says so. ``--write`` keeps the other kinds' values.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest

from datagen.data.contract import MANIFEST_NAME, Manifest
from datagen.specs.extraction import sha256_hex
from datagen.cli import build_parser, spec_from_namespace
from datagen.steps import load
from tests.builders import chat_dataset, make_model_dir

FIXTURE = Path(__file__).parent / "data" / "plan_regression.json"
IDENTITY = "regression-identity"  # the code's part of a cache key (runner_identity), fixed here
CASES = {
    "rows": {"samples_per_shard": 4, "shards_per_task": 2},
    "bytes": {"shard_bytes": 200_000, "layer_ids": [1, 3, 6], "shards_per_task": 2,
              "engine": {"name": "hf", "storage_dtype": "fp8_e4m3"}},
}


def _step(step: str, spec: dict, work: Path) -> dict:
    path = work / f"{step}-{len(list(work.glob(step + '-*.json')))}.json"
    path.write_text(json.dumps(spec))
    args = build_parser(only=step).parse_args([step, "--spec", str(path)])  # as `datagen STEP --spec FILE`
    return load(step).run(spec_from_namespace(step, load(step).Spec, args)).model_dump(mode="json")


def _manifest(out: Path, model: Path, rows: Path) -> dict:
    m = json.loads((out / MANIFEST_NAME).read_text())
    m.pop("created_at")
    assert m["spec"]["model"].pop("source") == str(model.resolve())
    assert m["spec"]["dataset"].pop("source") == str(rows.resolve())
    return m


def extraction_record(case: dict, root: Path) -> dict:
    """What one extraction of the tiny Llama leaves: the plan's keys, the ranges', the manifest, the shards."""
    from tasks.assemble import assemble_call
    from tasks.extract import finalize_cache_key, finalize_call, range_cache_key, range_call
    from tasks.pipeline_spec import parse_pipeline_spec
    from tasks.plan import PlanResult, plan_call

    model = make_model_dir(root / "llama", arch="llama", num_layers=6)
    rows = chat_dataset(root / "rows.jsonl", rows=14, seed=3)
    work = root / "work"
    work.mkdir()
    engine = case.get("engine", {"name": "hf"})
    spec = parse_pipeline_spec({"model": str(model), "dataset": str(rows), "output": str(root / "out"),
                                **case, "engine": engine}).resolved()
    xspec = spec.extract_spec(model_dir=str(model), model_revision=None)
    planned = PlanResult.model_validate(_step("plan", plan_call(xspec).spec, work))
    ranges = spec.ranges(planned.num_shards)
    range_results = [_step("extract", range_call(planned.plan, r).spec, work) for r in ranges]
    final = _step("extract", finalize_call(planned.plan).spec, work)
    out = Path(xspec.out)
    manifest = _manifest(out, model, rows)
    m = Manifest.model_validate_json((out / MANIFEST_NAME).read_bytes())
    shards = {s.path: sha256_hex((out / s.path).read_bytes()) for s in m.shards}
    # assemble, as a fanned-out run's parent: the same records, the manifest written again
    records = root / "records"
    shutil.copytree(out / ".datagen" / "shards", records)
    assembled = _step("assemble", assemble_call(planned.plan, str(records)).spec, work)
    return {
        "engine": manifest["spec"]["engine"]["name"] + " " + manifest["spec"]["engine"]["version"],
        "plan": {
            "fingerprint": planned.fingerprint, "extraction_fingerprint": planned.extraction_fingerprint,
            "num_shards": planned.num_shards, "rows": planned.rows, "tokens": planned.tokens,
            "layer_ids": list(planned.layer_ids), "shard_keys": list(planned.shard_keys),
            "shard_state_bytes": planned.shard_state_bytes, "shard_group": planned.shard_group,
        },
        "cache_keys": {
            "ranges": {r.arg: range_cache_key(planned, r, identity=IDENTITY, out="/fixed/out") for r in ranges},
            "finalize": finalize_cache_key(planned, identity=IDENTITY, out="/fixed/out"),
        },
        "ranges": [{k: res[k] for k in ("fingerprint", "extraction_fingerprint", "layer_ids", "shards_total",
                                         "shards_extracted", "tokens")} for res in range_results],
        "finalize": {k: final[k] for k in ("fingerprint", "totals", "shards")},  # its manifest: below
        "manifest": manifest,
        "shard_sha256": shards,
        "assembled": {"fingerprint": assembled["fingerprint"], "totals": assembled["totals"],
                      "manifest": _manifest(out, model, rows)},
    }


def _versions_differ(want: dict) -> str | None:
    import transformers

    have = f"hf {transformers.__version__}"
    return None if want["engine"] == have else f"the fixture was made with {want['engine']}, this is {have}"


NUMERIC = ("sha256", "layer_stats")  # the keys whose values the CPU's kernels decide


def cpu_kind() -> str:
    """The CPU's vendor and the vector kernels torch takes on it (AuthenticAMD AVX512, AuthenticAMD AVX2, ...)."""
    import torch

    vendor = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("vendor_id")), "unknown")
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()}"


def split(record: dict) -> tuple[dict, dict]:
    """(the record without what the kernels decide, those values: the shards' sha256 and the statistics)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in NUMERIC}
        return [strip(v) for v in x] if isinstance(x, list) else x

    rest = strip({k: v for k, v in record.items() if k != "shard_sha256"})
    return rest, {"shard_sha256": record["shard_sha256"], "layer_stats": record["manifest"]["layer_stats"],
                  "shard_layer_stats": [s["layer_stats"] for s in record["manifest"]["shards"]]}


def _agree_with_themselves(got: dict) -> None:
    m = got["manifest"]
    assert {s["path"]: s["sha256"] for s in m["shards"]} == got["shard_sha256"]
    assert {s["path"]: s["sha256"] for s in got["finalize"]["shards"]} == got["shard_sha256"]
    assert got["assembled"]["manifest"] == m


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_same_inputs_give_the_dataset_main_gave(name, tmp_path):
    want = json.loads(FIXTURE.read_text())[name]
    if (why := _versions_differ(want["record"])) is not None:
        pytest.skip(why)
    full = extraction_record(CASES[name], tmp_path)
    got, numbers = split(full)
    for part in want["record"]:
        assert got[part] == want["record"][part], part
    _agree_with_themselves(full)
    kind = cpu_kind()
    if kind in want["numbers"]:
        for part, value in want["numbers"][kind].items():
            assert numbers[part] == value, part
    else:
        warnings.warn(f"the fixture holds no shard bytes for this CPU ({kind}; it has "
                      f"{', '.join(want['numbers'])}): only their agreement with the manifests was checked")


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    old = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    fixture = {}
    for name, case in sorted(CASES.items()):
        with tempfile.TemporaryDirectory() as d:
            record, numbers = split(extraction_record(case, Path(d)))
        kinds = old.get(name, {}).get("numbers", {}) if old.get(name, {}).get("record") == record else {}
        fixture[name] = {"record": record, "numbers": {**kinds, cpu_kind(): numbers}}
    FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
