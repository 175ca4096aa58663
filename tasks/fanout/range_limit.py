"""The range's global concurrency limit on Prefect's server (limit 1): its one slot is the lease on
a shard range, which the parent makes (``parent.dispatch_range``) and the child holds
(``child.range_lease``); named for the dataset's fingerprint and the range."""

from __future__ import annotations

from prefect import get_client

from tasks.pipeline_spec import ShardRange

RANGE_LIMIT_PREFIX = "datagen-range"


def range_limit_name(fingerprint: str, shard_range: ShardRange) -> str:
    """The global concurrency limit (limit 1) whose one slot is the lease on a range."""
    return f"{RANGE_LIMIT_PREFIX}-{fingerprint[:16]}-{shard_range.first}-{shard_range.stop}"


def ensure_limit(name: str) -> None:
    """Create the range's limit (one slot) unless it exists; two runs may try at once."""
    from prefect.exceptions import ObjectAlreadyExists, PrefectHTTPStatusError

    with get_client(sync_client=True) as api:
        try:
            api.upsert_global_concurrency_limit_by_name(name, 1)
        except ObjectAlreadyExists:
            pass
        except PrefectHTTPStatusError as e:
            if e.response.status_code != 409:  # 409: created by the other run meanwhile
                raise


def delete_limit(name: str) -> None:
    """Remove the range's limit once the range is done (its child gave the slot back)."""
    try:
        with get_client(sync_client=True) as api:
            api.delete_global_concurrency_limit_by_name(name)
    except Exception:  # already gone, or the API is briefly unreachable: a leftover limit is harmless
        pass
