"""A dataset's images as the step programs reach them: the directories to mount (``media_sources``)
and, for images in a remote store, the S3 settings and credentials a step is given
(``media_step_env``). Every step that reads the rows uses both (plan, extract, assemble, validate)."""

from __future__ import annotations

from datagen.data.media_sources import MediaSources, sources
from tasks.settings import AWS_CREDENTIAL_ENV, s3_step_env


def media_sources(dataset: str) -> MediaSources:
    """Where the images of the rows of ``dataset`` are (a cheap scan, see ``datagen.data.media_sources.sources``):
    each directory is mounted read-only into the steps that read the rows. A read-write output
    inside one of them stays writable (Docker mounts a parent before what lies inside it)."""
    return sources(dataset)


def media_step_env(dataset: str) -> dict:
    """``StepCall`` fields for the images of ``dataset`` in a remote store (``s3://``): the S3
    settings (endpoint, region) and the credentials by name, as the download step gets them;
    nothing for a dataset without remote images."""
    if not media_sources(dataset).remote:
        return {}
    return {"env": s3_step_env(), "secret_env_names": AWS_CREDENTIAL_ENV}
