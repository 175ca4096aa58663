"""The fault campaign's fixtures: short or full campaign, and the record each case writes.

``make faults`` sets ``DATAGEN_FAULTS_FULL=1``: the full campaign (20 kills, every
infrastructure fault). A plain ``pytest tests`` (``make test``) runs the short version: a few
kills and every case that takes seconds.
"""

from __future__ import annotations

import os

import pytest

from tests.faults._results import CaseRecord, examples_scale, faults_seed, full_campaign  # noqa: F401  (the tests import it from here)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/faults/" in item.nodeid.replace(os.sep, "/"):
            item.add_marker(pytest.mark.faults)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call":
        # an expected failure (a reported, open bug) is not a pass, whatever the report says
        item._faults_call_passed = rep.passed and not hasattr(rep, "wasxfail")
        item._faults_call_error = None if rep.passed else str(rep.longrepr)[-1500:]
        # a case this machine cannot run (pytest.skip with its reason) is neither a pass nor a failure
        item._faults_call_skipped = (rep.longrepr[2] if isinstance(rep.longrepr, tuple) else "skipped") \
            if rep.skipped and not hasattr(rep, "wasxfail") else None
    return rep


@pytest.fixture
def case(request):
    """A CaseRecord for this test; written to the results directory when the test ends.

    The test fills in case, category, attempts, outcome and data_lost; ``passed`` comes from
    the test's own result, so a failing case is recorded as failed.
    """
    node = request.node.nodeid
    rec = CaseRecord(case=request.node.name, category="bad-input", command=f"pytest {node}")
    yield rec
    passed = getattr(request.node, "_faults_call_passed", False)
    rec.passed = bool(passed)
    skipped = getattr(request.node, "_faults_call_skipped", None)
    if skipped:
        rec.outcome = f"SKIPPED: {skipped.removeprefix('Skipped: ')}"
    elif not passed:
        rec.details.setdefault("error", getattr(request.node, "_faults_call_error", None))
        if not rec.outcome:
            rec.outcome = "FAILED"
    rec.write()
