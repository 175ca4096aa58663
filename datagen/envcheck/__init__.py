"""The env-check library: will this spec run here? Answered in seconds, before any GPU hour.

The step ``datagen env-check`` (``datagen.steps.env_check``) is thin over it. Each check is a
``Check`` line of the ``EnvReport`` (``report``):

* accelerators: count, model, memory, driver and CUDA version (``datagen.engines.accelerators``);
  the spec's tensor parallel size fits the GPUs (and the model fits their memory); on a
  CPU-only machine, that the CPU build of vLLM is installed (``engine``);
* the engine: vLLM installed at a tested version (``datagen.engines.patches``), every patch's
  self-test passes, the model's architecture supports aux hidden-state capture; the report's
  ``engine`` says which capture path (internal or public, ``datagen.engines.capture_paths``) and
  which model runner a run takes on the installed vLLM, and why; on the public path its self-test
  runs with the patches' (``engine``);
* the model: config readable (from the local dir, the S3 mirror or the Hub, without
  downloading weights), layer ids valid for its depth, hidden size (``model``);
* storage: free space at the model cache (model size, less what is cached) and at a local
  output (tokens x layers x hidden x bytes per value, from the spec's ``expected_tokens``)
  (``space``);
* remotes: an S3 output is writable (a probe object written, read back and deleted); a Hub
  model's token is present when the model is gated (the token itself is never printed)
  (``remote``).

``run.check`` runs them all in order and returns the report; ``run.raise_for_report`` turns a
failed check into ``CannotRunHereError`` and one that could not tell into ``TransientError``.
Nothing is re-exported here: import from the module that holds the name.
"""
