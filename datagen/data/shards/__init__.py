"""Shards: the files that hold the hidden states, one module per concern.

- ``format``: the format name, storage dtypes and fp8 layout, ``ShardJob`` (what one shard holds
  but its states; its own fields cross the RPC to the workers as plain lists, the run's
  ``ShardFormat`` once, at the engine's start) and the safetensors header.
- ``kernels``: per-token statistics and fp8 quantization where the states are (the GPU in the
  capture), and the per-layer statistics added up from them.
- ``writer``: ``write_shard``, the file image packed once, hashed while O_DIRECT writes run,
  fsynced and renamed into place.

The criterion that widens a golden comparison by fp8's rounding is validation's
(``datagen.validation.compare.fp8_allowance``).
"""
