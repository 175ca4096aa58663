"""The step tasks' cache key: the flow's ``cache_key`` argument and the shape of the cached result.

A record is JSON of the task's result type. A record written before that type changed could not be
read back as the new type, so the key changes with the type and such a record is never found.
"""

from __future__ import annotations

from types import SimpleNamespace

from pydantic import BaseModel

from datagen.steps import result_type
from tasks.extract import RangeOutcome
from tasks.step import StepCall, _cache_key_argument, _result_schema_digest


def _context(fn=None):
    return SimpleNamespace(task=SimpleNamespace(fn=fn))


def test_a_call_without_a_key_is_not_cached():
    assert _cache_key_argument(_context(), {"call": StepCall(step="extract", spec={})}) is None


def test_the_key_is_the_argument_and_the_result_shape_of_the_step():
    key = _cache_key_argument(_context(), {"call": StepCall(step="extract", spec={}), "cache_key": "extract-range-abc"})
    assert key.startswith("extract-range-abc-r") and key != "extract-range-abc"
    again = _cache_key_argument(_context(), {"call": StepCall(step="extract", spec={}, label="0:2"), "cache_key": "extract-range-abc"})
    assert key == again  # the call's other fields are not part of it: the flow's key says what decides the output
    assert key != _cache_key_argument(_context(), {"call": StepCall(step="publish", spec={}), "cache_key": "extract-range-abc"})
    assert key.endswith(_result_schema_digest(result_type("extract")))


def test_a_result_type_that_gains_a_field_gets_another_key():
    class Before(BaseModel):
        tokens: int

    class After(BaseModel):
        tokens: int
        seconds: float = 0.0

    class Renamed(BaseModel):
        tokens_total: int

    digests = {_result_schema_digest(t) for t in (Before, After, Renamed)}
    assert len(digests) == 3


def test_a_fan_out_task_is_keyed_on_its_declared_return_type():
    def dispatch(cache_key: str) -> RangeOutcome: ...

    def other(cache_key: str) -> RangeOutcome | None: ...

    key = _cache_key_argument(_context(dispatch), {"cache_key": "range-1"})
    assert key == f"range-1-r{_result_schema_digest(RangeOutcome)}"
    assert key != _cache_key_argument(_context(other), {"cache_key": "range-1"})


def test_a_result_type_that_moves_gets_another_key():
    """A record names its type by import path: the same fields under another path are another key."""
    Here = type("ExtractResult", (BaseModel,), {"__annotations__": {"tokens": int}, "__module__": "tasks.extract"})
    There = type("ExtractResult", (BaseModel,), {"__annotations__": {"tokens": int}, "__module__": "datagen.steps.extract"})
    assert _result_schema_digest(Here) != _result_schema_digest(There)
