"""Fan-out: shard ranges as flow runs of the `extract-shards` deployment, the dataset in a bucket.

Nothing here is a scheduler or a lock of ours: exclusivity, lost hosts and placement are Prefect's,
and the only store hosts share is the dataset's bucket (``datagen.storage.fleet``).

* ``parent``: the `extract` flow's side (``ranges_in_flight > 1``): what the bucket holds, one range
  dispatched as a flow run and watched, the merge through ``assemble``, the manifest published last.
* ``child``: one range's flow run (``flows/extract_shards.py``): the range's lease, this host's GPU
  slots, the range extracted into the bucket, its receipt.
* ``range_limit``: the range's global concurrency limit, which the parent makes and the child holds.

Both reach the bucket through ``tasks/bucket.py``.
"""
