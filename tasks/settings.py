"""Every environment variable the orchestration layer (``tasks/``, ``flows/``) reads, read when asked.

The step programs' own settings are in ``datagen.settings``.
"""

from __future__ import annotations

import os

S3_SETTINGS_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION")


def s3_step_env() -> dict[str, str]:
    """The non-secret S3 settings set here (endpoint, region), passed on to the steps that use S3."""
    return {k: os.environ[k] for k in S3_SETTINGS_ENV if k in os.environ}
