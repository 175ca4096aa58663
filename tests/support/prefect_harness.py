"""Prefect's test harness (a temporary server and database) with a result store of its own.

Import the fixture into a conftest::

    from tests.support.prefect_harness import prefect_harness  # noqa: F401

Several conftests import it, and pytest makes one session fixture per conftest: the first one
started runs the harness, the others reuse it (two harnesses at once would leave Prefect's
events client talking to the wrong server).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.marks import PREFECT_SERVER, starts
from tests.support.prefect_server import seed_database

_active: list[Path] = []  # the storage directory of the running harness, if one runs


@pytest.fixture(scope="session")
@starts(PREFECT_SERVER, "Prefect's test harness (a temporary Prefect server)")
def prefect_harness(tmp_path_factory):
    """Flows run against a temporary Prefect server; cache records go to a temporary directory."""
    if _active:
        yield _active[0]
        return
    import prefect.testing.utilities as harness
    from prefect.settings import (
        PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings,
    )

    storage = tmp_path_factory.mktemp("prefect-results")
    # Analytics off: its heartbeat competes with the runs for the harness's SQLite database.
    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_SERVER_ANALYTICS_ENABLED: False}), \
            pytest.MonkeyPatch.context() as patch:
        # the harness's database starts as a copy of a migrated one, as the real servers' do
        # (tests/support/prefect_server.py); where there is no template yet, from nothing
        patch.setattr(harness, "mkdtemp", _seeded_temp_dir(harness.mkdtemp))
        with harness.prefect_test_harness(server_startup_timeout=120):
            _active.append(storage)
            try:
                yield storage
            finally:
                _active.clear()


def _seeded_temp_dir(mkdtemp):
    """``mkdtemp`` for the harness: the folder of its database (``prefect-test.db``), holding a
    copy of the migrated template where there is one. Prefect's harness (3.9) makes that folder
    with its module's ``mkdtemp`` and names the file so; should a release do otherwise, its harness
    starts from nothing, as before, only slower."""

    def seeded(*args, **kwargs) -> str:
        folder = mkdtemp(*args, **kwargs)
        seed_database(Path(folder) / "prefect-test.db")
        return folder

    return seeded
