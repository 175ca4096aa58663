"""A cache key is a file name that changes with every part it is made of."""

from __future__ import annotations

from tasks.cache_keys import cache_key


def test_cache_keys_are_file_names_that_depend_on_every_part():
    k = cache_key("extract-range", ["a", "b"], "local:1", "/out")
    assert k.startswith("extract-range-") and "/" not in k
    assert k == cache_key("extract-range", ["a", "b"], "local:1", "/out")
    assert k != cache_key("extract-range", ["a", "c"], "local:1", "/out")
