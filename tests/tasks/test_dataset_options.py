"""A dataset named with options (``PATH#split=..&format=..``) or a folder: every step that reads its
rows gets the whole name in its spec, the container mounts the path alone (a bind mount of
``PATH#split=..`` would name no file or folder, and Docker refuses it), and a cache key hashes the
dataset as the loader reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.specs.extraction import ExtractSpec
from datagen.validation.settings import ValidationSettings
from tasks.mounts import dataset_path


def hf_folder(root: Path) -> Path:
    """A folder that stands for a saved Hugging Face dataset (the mounts read no file of it)."""
    (root / "hf").mkdir(parents=True)
    return root / "hf"


def read_only(call) -> set[str]:
    return {m.path for m in call.mounts if m.read_only}


def test_the_path_of_a_dataset_is_its_name_without_the_options(tmp_path):
    assert dataset_path(f"{tmp_path}/hf#split=train&format=sharegpt") == tmp_path / "hf"
    assert dataset_path(f"{tmp_path}/rows.jsonl") == tmp_path / "rows.jsonl"


def test_plan_and_extract_mount_the_datasets_path_and_pass_the_options(tmp_path):
    from tasks.extract import finalize_call, range_call
    from tasks.mounts import extract_mounts
    from tasks.pipeline_spec import ShardRange
    from tasks.plan import plan_call
    from tests.support.plan_records import plan_record

    data = f"{hf_folder(tmp_path)}#split=train&format=sharegpt"
    spec = ExtractSpec(model=str(tmp_path / "m"), dataset=data, out=str(tmp_path / "out"), layer_ids=[1])
    assert {m.path for m in extract_mounts(spec)} == {str(tmp_path), str(tmp_path / "hf"), str(tmp_path / "m")}
    planned = plan_record(spec=spec)
    for call in (plan_call(spec), range_call(planned, ShardRange(first=0, stop=1)), finalize_call(planned)):
        assert str(tmp_path / "hf") in read_only(call) and not any("#" in m.path for m in call.mounts), call.step
        assert (call.spec.get("plan", {}).get("spec") or call.spec)["dataset"] == data, call.step


def test_regenerate_mounts_the_datasets_path_and_passes_the_options(tmp_path):
    from tasks.pipeline_spec import PipelineSpec
    from tasks.regenerate import regenerate_call

    data = f"{hf_folder(tmp_path)}#split=train"
    spec = PipelineSpec.model_validate({"model": str(tmp_path / "m"), "dataset": data, "output": str(tmp_path / "o"),
                                        "regenerate": {"max_model_len": 256}})
    call = regenerate_call(spec, spec.regenerate, model_dir=str(tmp_path / "m"), model_revision=None)
    assert read_only(call) == {str(tmp_path / "m"), str(tmp_path / "hf")}
    assert call.spec["dataset"] == data


def test_validate_mounts_the_sources_path_and_passes_the_options(tmp_path):
    from tasks.validate import validate_call

    source = f"{hf_folder(tmp_path)}#split=train"
    call = validate_call(str(tmp_path / "ds"), settings=ValidationSettings(), report=tmp_path / "r.json",
                         model=str(tmp_path / "m"), source=source)
    assert read_only(call) == {str(tmp_path / "m"), str(tmp_path / "hf")}
    assert call.spec["source"] == source


def test_regenerates_cache_key_hashes_a_folder_with_options_as_the_loader_reads_it(tmp_path):
    from datagen.data.checksums import sha256_file
    from tasks.cache_keys import cache_key
    from tasks.pipeline_spec import PipelineSpec
    from tasks.regenerate import STEP, regenerate_cache_key

    def key(data: str) -> str:
        spec = PipelineSpec.model_validate({"model": "m", "dataset": data, "output": str(tmp_path / "o"),
                                            "regenerate": {"max_model_len": 256}})
        return regenerate_cache_key(spec, spec.regenerate, model_revision="r", model_dir="m", identity="code")

    folder = tmp_path / "chats"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"messages": []}\n')
    before = key(f"{folder}#format=messages")
    assert key(f"{folder}#format=messages") == before and key(str(folder)) != before  # the options are read too
    (folder / "a.jsonl").write_text('{"messages": [], "id": 1}\n')
    assert key(f"{folder}#format=messages") != before
    # a JSONL file's key is the one it always had: over its bytes' sha256
    settings = PipelineSpec.model_validate({"model": "m", "dataset": "d", "output": str(tmp_path / "o"),
                                            "regenerate": {"max_model_len": 256}}).regenerate
    assert key(str(folder / "a.jsonl")) == cache_key(STEP, "r", sha256_file(folder / "a.jsonl"),
                                                     settings.model_dump(mode="json"), "code", f"{tmp_path / 'o'}-regenerated")


@pytest.mark.docker
def test_a_plan_step_in_its_container_reads_a_hugging_face_dataset_named_with_options(tiny_llama, tmp_path):
    """The mounts as Docker makes them: `datagen plan` in the extract image reads the split the
    options name from the dataset folder mounted without them, as this process does."""
    import datasets

    from datagen.extraction.plan import plan
    from images.tags import ImageName
    from tasks.step_files import spec_file
    from tasks.docker_runner import DockerRunner
    from tasks.plan import plan_call
    from tasks.runners import Mount, StepInvocation
    from tests.support.docker_engine import built_images

    chats = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]}
             for i in range(3)]
    hf = datasets.Dataset.from_list(chats)
    datasets.DatasetDict({"train": hf, "test": hf.select([0])}).save_to_disk(str(tmp_path / "hf"))
    spec = ExtractSpec(model=str(tiny_llama), dataset=f"{tmp_path / 'hf'}#split=train&format=messages",
                       out=str(tmp_path / "out" / "ds"), layer_ids=[1], engine={"name": "vllm"})
    here = plan(spec.model_copy(update={"engine": spec.engine.model_copy(update={"name": "hf"})}))
    assert here.data.rows == 3

    tags = built_images(ImageName.STEPS, ImageName.EXTRACT_CPU)
    runner = DockerRunner({"*": tags[ImageName.STEPS], "plan": tags[ImageName.EXTRACT_CPU]})
    call = plan_call(spec)
    with spec_file(call.spec) as path:
        outcome = runner.run(StepInvocation(step="plan", args=("--spec", str(path)),
                                            mounts=(*call.mounts, Mount(str(path.parent), read_only=True))),
                             lambda line: None)
    assert outcome.ok, outcome.last_lines
    assert outcome.result["rows"] == 3 and outcome.result["tokens"] == here.data.tokens
