"""Which runner runs a step (``make_runner``: the one the pipeline spec names) and, for the docker
runner, which image runs each step (``_step_images``)."""

from __future__ import annotations

from tasks.pipeline_spec import Runner
from tasks.runners import StepRunner


def make_runner(kind: Runner, *, gpu: bool = False) -> StepRunner:
    """The runner the spec names; ``gpu`` picks the CUDA extract image for the docker runner.

    Raises:
        datagen.errors.CannotRunHereError: docker: the images are not built or no engine answers.
    """
    if kind is Runner.LOCAL:
        from tasks.local_runner import LocalRunner

        return LocalRunner()
    from tasks.docker_runner import DockerRunner

    return DockerRunner(_step_images(gpu=gpu))


def extract_image(gpu: bool):
    """The image the extraction runs in: CUDA's or the CPU's."""
    from images.tags import ImageName

    return ImageName.EXTRACT_CUDA if gpu else ImageName.EXTRACT_CPU


def _step_images(*, gpu: bool) -> dict[str, str]:
    """Step name -> image tag of the current tree (each image must be built)."""
    from images.tags import ImageName, plan_image, resolve_image

    steps = resolve_image(ImageName.STEPS).tag
    extract = resolve_image(extract_image(gpu)).tag
    # plan reads the engine's version (part of every fingerprint): it runs in the engine's image.
    # assemble plans the spec again (the engine's version is in every fingerprint): the same image.
    # validate may re-extract golden rows with the engine itself (models transformers cannot load).
    # regenerate generates with the engine (vLLM offline generation).
    # train and measure-draft: the train image (speculators), resolved when a train run starts its step
    train = plan_image(ImageName.TRAIN_CUDA if gpu else ImageName.TRAIN_CPU).tag
    return {"*": steps, "extract": extract, "plan": extract, "assemble": extract, "env-check": extract,
            "validate": extract, "regenerate": extract, "train": train, "measure-draft": train}
