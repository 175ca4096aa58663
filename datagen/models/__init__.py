"""Models as files: what a checkpoint is without loading it (``modelinfo``), and the tiny
random-weight checkpoints, tokenizers and chat datasets the demo and the tests are made of
(``tiny``, ``tiny_kimi``, ``tiny_tiktoken``)."""
