"""Fixtures of the task tests."""

from tests.support.prefect_harness import prefect_harness  # noqa: F401
