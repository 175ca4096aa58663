"""Every environment variable the orchestration layer (``tasks/``, ``flows/``) reads, read when asked.

The step programs' own settings are in ``datagen.settings``.
"""

from __future__ import annotations

import os
from pathlib import Path

# TEST HOOK. Path of a JSON file of faults the local runner injects instead of running a step:
#   {"<task label or step name>": {"exit_code": 75, "times": 1, "message": "..."}}
# Each injection decrements "times". Only the test suite sets it; nothing else reads the file.
TEST_HOOK_FAULTS_ENV = "DATAGEN_TEST_HOOK_FAULTS"


def fault_hook_file() -> Path | None:
    """DATAGEN_TEST_HOOK_FAULTS: the fault file of the tests, or None (always, outside tests)."""
    raw = os.environ.get(TEST_HOOK_FAULTS_ENV)
    return Path(raw) if raw else None


S3_SETTINGS_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION")


def s3_step_env() -> dict[str, str]:
    """The non-secret S3 settings set here (endpoint, region), passed on to the steps that use S3."""
    return {k: os.environ[k] for k in S3_SETTINGS_ENV if k in os.environ}
