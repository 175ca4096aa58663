"""The checks behind ``datagen validate`` (the step module is ``datagen.steps.validate``).

dataset     ``validate``: every check below in order, the report (the step's work)
report      problem records and the JSON report
shardfile   safetensors shard files: bounded header parsing, memory-mapped one-pass scans
manifest    checks of manifest.json on its own (version, fingerprints, ranges, paths)
scan        per-shard checks: checksum, tensors, offsets, rows, statistics, non-finite values
source      a fresh tokenization of the source rows compared with the stored tokens
golden      re-extraction of a few random rows with the reference engine
drift       statistics compared with a previous dataset
compare     the criterion two engines' hidden states are compared by
"""
