"""What a dataset is: the extraction spec and its fingerprints (``spec``), the data contract
(``contract``: manifest, shard records, tensor names), the source rows (``dataset``), the shard
files (``shards``) and file checksums (``checksums``). The lowest floor: it imports only
``datagen.errors`` and ``datagen.settings``."""
