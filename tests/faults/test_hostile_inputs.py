"""Hostile inputs: manifests, records, model indexes and mirrors whose paths lead out of their
directory (``../``, absolute paths, symlinks), oversized safetensors headers, models asking to run
their own code. Every reader refuses them; nothing outside is read, written or executed.

The data contract has no sample names (shards are named by index, exported samples by row
number), so the paths that can escape are shard paths, weight-file names and mirror keys.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from datagen.data.contract import MANIFEST_NAME
from datagen.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_VALIDATION
from tests.builders import write_jsonl
from tests.faults._refusal import assert_refused, run_cli
from tests.support.extracted import extracted_dataset

ROWS = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}, {"input_ids": [9, 10, 11]}]


def _record(case, name: str, outcome: str, **details) -> None:
    case.category = "hostile"
    case.case = name
    case.attempts = 1
    case.outcome = outcome
    case.data_lost = "0"
    case.details.update(details)


def _approve(ds: Path) -> None:
    """What an attacker who can write the dataset could forge: a validation record for it."""
    import hashlib

    sha = hashlib.sha256((ds / MANIFEST_NAME).read_bytes()).hexdigest()
    (ds / ".datagen" / "validation.json").write_text(json.dumps({"ok": True, "manifest_sha256": sha}))


@pytest.fixture
def dataset(tmp_path_factory, tmp_path) -> Path:
    return shutil.copytree(extracted_dataset(tmp_path_factory), tmp_path / "ds")


@pytest.fixture
def outside(tmp_path, dataset) -> Path:
    """A file outside the dataset: a copy of shard 0 (so only its place is wrong), and a secret."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    shutil.copy(dataset / "shards" / "shard-000000.safetensors", d / "shard.safetensors")
    return d / "shard.safetensors"


ESCAPES = {
    "../ parent path": lambda ds, out: "../elsewhere/shard.safetensors",
    "nested ../": lambda ds, out: "shards/../../elsewhere/shard.safetensors",
    "absolute path": lambda ds, out: str(out),
    "symlink to a file outside": None,  # the path is the usual one; the file is a link
}


@pytest.mark.parametrize("kind", list(ESCAPES))
def test_a_shard_path_leading_out_of_the_dataset_is_refused_by_every_reader(dataset, outside, tmp_path, case, kind):
    m = json.loads((dataset / MANIFEST_NAME).read_text())
    if ESCAPES[kind] is None:
        link = dataset / m["shards"][0]["path"]
        link.unlink()
        link.symlink_to(outside)
    else:
        m["shards"][0]["path"] = ESCAPES[kind](dataset, outside)
        (dataset / MANIFEST_NAME).write_text(json.dumps(m))
    (dataset / ".datagen" / "validation.json").unlink(missing_ok=True)

    v = run_cli("validate", dataset, "--golden", "0", "--report", tmp_path / "report.json")
    assert_refused(v, code=EXIT_VALIDATION, message="unsafe_path")
    assert not (dataset / ".datagen" / "validation.json").exists()

    x = run_cli("export", "--format", "speculators", dataset, tmp_path / "export")
    assert_refused(x, code=EXIT_BAD_INPUT, message="escapes the dataset directory")
    assert not (tmp_path / "export").exists()

    readers = ["validate (exit 4, unsafe_path)", "export (exit 2)"]
    if ESCAPES[kind] is not None:
        # publish re-checks paths even with a (forged) validation record; a symlink cannot pass
        # validation, and publish uploads only bytes whose sha256 the validated manifest names
        _approve(dataset)
        p = run_cli("publish", dataset, "--to=s3://bucket/x")
        assert_refused(p, code=EXIT_BAD_INPUT, message="outside the dataset")
        readers.append("publish with a forged validation record (exit 2, before any upload)")
    _record(case, f"manifest shard path: {kind}", "refused by " + ", ".join(readers))


def test_a_record_naming_a_path_outside_is_not_taken_as_a_finished_shard(tiny_llama, tmp_path, case):
    """A resumed extraction reads .datagen/shards/*.json: a record pointing outside the output (or
    a shard file replaced by a symlink) must not make a shard 'complete'."""
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "out"
    args = ("extract", "--model", tiny_llama, "--dataset", data, "--out", out, "--engine", "hf", "--samples-per-shard", "1")
    assert run_cli(*args).code == EXIT_OK
    (out / MANIFEST_NAME).unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(out / "shards" / "shard-000000.safetensors", elsewhere / "x.safetensors")
    rec = out / ".datagen" / "shards" / "shard-000000.json"
    r = json.loads(rec.read_text())
    r["path"] = "../elsewhere/x.safetensors"
    rec.write_text(json.dumps(r))
    (out / "shards" / "shard-000000.safetensors").unlink()
    link = out / "shards" / "shard-000001.safetensors"
    shutil.copy(link, elsewhere / "y.safetensors")
    link.unlink()
    link.symlink_to(elsewhere / "y.safetensors")
    before = (elsewhere / "y.safetensors").read_bytes()

    o = run_cli(*args)
    assert o.code == EXIT_OK, o.err
    result = json.loads(o.out.split("datagen-result: ")[1])
    assert result["shards_extracted"] == [0, 1]
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert [s["path"] for s in m["shards"]] == ["shards/shard-000000.safetensors", "shards/shard-000001.safetensors"]
    assert not link.is_symlink() and (elsewhere / "y.safetensors").read_bytes() == before
    _record(case, "extraction resume: a shard record pointing outside, a shard file that is a symlink",
            "both shards extracted again; the link replaced by a regular file, its target untouched "
            "(was: both taken as complete, the manifest listing ../elsewhere)")


def test_a_weight_index_naming_files_outside_the_model_is_refused(tiny_llama, rows_file, tmp_path, case):
    model = shutil.copytree(tiny_llama, tmp_path / "model")
    (tmp_path / "outside.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    raw = (model / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    weight_map = {name: "../outside.safetensors" for name in header if name != "__metadata__"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "out": str(tmp_path / "out"), "model_cache": str(tmp_path / "c")}))
    for argv in (("extract", "--model", model, "--dataset", rows_file, "--out", tmp_path / "out", "--engine", "hf"),
                 ("download", "--spec", spec)):
        assert_refused(run_cli(*argv), code=EXIT_BAD_INPUT, message="outside the model directory")
    assert not (tmp_path / "out").exists()
    _record(case, "model index (model.safetensors.index.json) naming ../outside.safetensors",
            "refused by extract and download (was: the outside file's header read and accepted as a weight file)")


@pytest.fixture
def rows_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "rows.jsonl", ROWS)


def test_mirror_keys_leading_out_of_the_model_cache_are_refused(monkeypatch, case):
    from datagen.errors import DatagenError
    from datagen.storage import s3 as s3mod
    from datagen.storage.s3_mirror import list_mirror
    from datagen.specs.source import parse_s3_uri

    source = parse_s3_uri("s3://mirror/models/tiny")
    # what an S3 listing returns for keys the server allows (AWS does): prefix + "/" + rel
    rels = ["config.json", "../../../../tmp/evil.safetensors", "/etc/evil.safetensors", "model.safetensors"]
    objects = [s3mod.ObjectInfo(key=f"models/tiny/{rel}", size=1, etag="x") for rel in rels]
    monkeypatch.setattr(s3mod, "list_objects", lambda client, src: objects)
    name = "S3 model mirror listing keys <prefix>/../../../../tmp/evil.safetensors and <prefix>//etc/evil.safetensors"
    try:
        mirror = list_mirror(None, source, trust_remote_code=False)
    except DatagenError as e:
        _record(case, name, f"refused before anything is fetched (exit {e.exit_code}) (was: both selected for "
                            "download, their local paths outside the model cache)")
        assert e.exit_code == EXIT_BAD_INPUT and e.hint
        return
    bad = [f.rel for f in mirror.files if ".." in Path(f.rel).parts or f.rel.startswith("/")]
    _record(case, name, f"selected for download outside the model cache: {bad}")
    pytest.fail(f"selected for download outside the cache: {bad}")


# --- oversized safetensors headers -----------------------------------------------------------------

def _huge_header_file(path: Path) -> None:
    path.write_bytes((10**12).to_bytes(8, "little") + b"{" + b" " * 100)


def test_an_oversized_header_in_an_output_being_resumed_is_not_read(tiny_llama, rows_file, tmp_path, case):
    """A crash leaves a file under a shard's name with no record: the resume reads its header to
    recover the record. A hostile header claiming 1 TB must not be allocated, and the shard is
    extracted again."""
    import resource

    out = tmp_path / "out"
    args = ("extract", "--model", tiny_llama, "--dataset", rows_file, "--out", out, "--engine", "hf", "--samples-per-shard", "1")
    assert run_cli(*args).code == EXIT_OK
    (out / MANIFEST_NAME).unlink()
    (out / ".datagen" / "shards" / "shard-000001.json").unlink()
    _huge_header_file(out / "shards" / "shard-000001.safetensors")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    o = run_cli(*args)
    assert o.code == EXIT_OK, o.err
    assert json.loads(o.out.split("datagen-result: ")[1])["shards_extracted"] == [1]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 512 * 1024  # KiB: no 1 TB allocation
    _record(case, "shard file with a 1 TB header claim in an output being resumed",
            "not read as a shard: extracted again, no allocation")


def test_an_oversized_header_is_refused_by_export_and_by_download(dataset, tiny_llama, tmp_path, case):
    m = json.loads((dataset / MANIFEST_NAME).read_text())
    _huge_header_file(dataset / m["shards"][1]["path"])
    x = run_cli("export", "--format", "speculators", dataset, tmp_path / "export")
    assert x.code in (EXIT_VALIDATION, EXIT_BAD_INPUT), x.err
    assert_refused(x, code=x.code, message="header")
    assert not (tmp_path / "export").exists()

    model = shutil.copytree(tiny_llama, tmp_path / "model")
    _huge_header_file(model / "model.safetensors")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "out": str(tmp_path / "out"), "model_cache": str(tmp_path / "c")}))
    assert_refused(run_cli("download", "--spec", spec), code=EXIT_BAD_INPUT, message="header")
    _record(case, "1 TB safetensors header claim in a dataset shard (export) and in a model (download)",
            f"refused: export exit {x.code}, download exit 2, nothing allocated or written")


# --- models asking to run their own code ------------------------------------------------------------

EVIL_CODE = '''
import os, pathlib
pathlib.Path(os.environ["DATAGEN_FAULTS_MARKER"]).write_text("remote code ran")
from transformers import LlamaForCausalLM, LlamaConfig
class EvilForCausalLM(LlamaForCausalLM):
    pass
class EvilConfig(LlamaConfig):
    pass
'''


def _evil_model(src: Path, dst: Path, *, architecture: str) -> Path:
    model = shutil.copytree(src, dst)
    (model / "modeling_evil.py").write_text(EVIL_CODE)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = [architecture]
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.fixture
def marker(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "REMOTE_CODE_RAN"
    monkeypatch.setenv("DATAGEN_FAULTS_MARKER", str(path))
    return path


def test_a_model_asking_for_its_own_code_never_runs_it_unless_allowed(tiny_llama, rows_file, tmp_path, marker, case):
    unknown = _evil_model(tiny_llama, tmp_path / "unknown", architecture="EvilForCausalLM")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(unknown), "out": str(tmp_path / "o"), "model_cache": str(tmp_path / "c")}))
    assert_refused(run_cli("download", "--spec", spec), code=EXIT_BAD_INPUT, message="its own Python code")
    assert_refused(run_cli("extract", "--model", unknown, "--dataset", rows_file, "--out", tmp_path / "o",
                           "--engine", "hf"), code=EXIT_BAD_INPUT, message="its own Python code")
    assert not (tmp_path / "o").exists()
    # a supported architecture with an auto_map: the built-in implementation runs, never the code
    known = _evil_model(tiny_llama, tmp_path / "known", architecture="LlamaForCausalLM")
    o = run_cli("extract", "--model", known, "--dataset", rows_file, "--out", tmp_path / "o2", "--engine", "hf")
    assert o.code == EXIT_OK, o.err
    assert not marker.exists(), "the model's own code ran without the spec allowing it"
    _record(case, "model with auto_map + modeling_evil.py, spec without trust_remote_code",
            "unsupported architecture: refused by download and extract; supported one: built-in class used; "
            "the model's code never ran")


def test_validate_never_runs_model_code_because_a_manifest_says_so(tiny_llama, rows_file, tmp_path, marker, case):
    from datagen.specs.extraction import canonical_json, sha256_hex

    model = _evil_model(tiny_llama, tmp_path / "model", architecture="LlamaForCausalLM")
    out = tmp_path / "ds"
    assert run_cli("extract", "--model", model, "--dataset", rows_file, "--out", out, "--engine", "hf").code == EXIT_OK
    assert not marker.exists()
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["spec"]["engine"]["trust_remote_code"] = True  # the edit, with fingerprints an attacker can recompute
    spec = dict(m["spec"])
    dataset = spec.pop("dataset")
    spec["model"] = {k: v for k, v in spec["model"].items() if k != "source"}
    m["extraction_fingerprint"] = sha256_hex(canonical_json(spec))
    m["fingerprint"] = sha256_hex(canonical_json({"extraction": m["extraction_fingerprint"], "dataset": dataset["sha256"]}))
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    run_cli("validate", out, "--golden", "1")
    _record(case, "manifest edited to trust_remote_code=true, then `datagen validate`",
            "the model directory's code ran (golden check / fresh tokenization)" if marker.exists() else
            "the model's code never ran (was: imported by the golden check and the fresh tokenization)")
    assert not marker.exists(), "validate imported the model's own code because the manifest said so"
