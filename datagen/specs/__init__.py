"""The spec, declared once: the user's model source (``source``), what an extraction holds and the engine's
settings (``extraction``), and the plan `datagen plan` resolves it to (``plan``), which every later step is
given. Records only: nothing here inspects a model, reads a dataset or imports torch."""
