"""Every environment variable the orchestration layer (``tasks/``, ``flows/``) reads, read when asked.

The step programs' own settings are in ``datagen.settings``.
"""

from __future__ import annotations

import os
from pathlib import Path

S3_SETTINGS_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION")

# Credentials a step may need, passed to it by name only (their values are never logged).
AWS_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
HUB_AND_AWS_CREDENTIAL_ENV = ("HF_TOKEN", *AWS_CREDENTIAL_ENV)


def s3_step_env() -> dict[str, str]:
    """The non-secret S3 settings set here (endpoint, region), passed on to the steps that use S3."""
    return {k: os.environ[k] for k in S3_SETTINGS_ENV if k in os.environ}


# the engine's settings (datagen.settings) a worker may be given; a local step inherits them with the
# worker's environment, a step container gets them passed on (tasks/docker_runner.py)
ENGINE_SETTINGS_ENV = ("DATAGEN_ENFORCE_EAGER", "DATAGEN_CPU_KVCACHE_GIB", "DATAGEN_GPU_MEMORY_UTILIZATION",
                       "DATAGEN_CPU_ENGINE_IN_PROCESS")


def engine_step_env() -> dict[str, str]:
    """The engine settings set here, passed on to a step container as a local step inherits them."""
    return {k: os.environ[k] for k in ENGINE_SETTINGS_ENV if k in os.environ}


def compile_cache() -> Path | None:
    """The host folder every step container keeps its compiled kernels in (DATAGEN_COMPILE_CACHE;
    default ~/.cache/datagen/compile; "off": none, each container compiles afresh)."""
    value = os.environ.get("DATAGEN_COMPILE_CACHE", "")
    if value.lower() == "off":
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "datagen" / "compile"
