"""Models as files: what a checkpoint is without loading it (``modelinfo``), loading a tokenizer
(``tokenizer``; Kimi's, converted: ``kimi_tokenizer``), and Kimi-K2.5's config, image processor and
tokenizer code as a checkpoint ships them. The checkpoints the demo and the tests are made of are
generated in ``datagen.testmodels``."""
