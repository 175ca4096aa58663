"""Prefect's test harness (a temporary server and database) with a result store of its own.

Import the fixture into a conftest::

    from tests.support.prefect_harness import prefect_harness  # noqa: F401
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """Flows run against a temporary Prefect server; cache records go to a temporary directory."""
    from prefect.settings import (
        PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect-results")
    # Analytics off: its heartbeat competes with the runs for the harness's SQLite database.
    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_SERVER_ANALYTICS_ENABLED: False}):
        with prefect_test_harness(server_startup_timeout=120):
            yield storage
