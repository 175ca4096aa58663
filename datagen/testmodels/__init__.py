"""The checkpoints the demo, ``datagen make-tiny`` and the tests are made of, generated here: tiny
random-weight models, a locally trained tokenizer and chat datasets (``tiny``), the tiny Kimi-K2.5
(``tiny_kimi``, its weights ``tiny_kimi_weights``, its tiktoken tokenizer ``tiny_tiktoken``), and the
real trained SmolLM2-135M-Instruct built from its package (``smollm2``). A floor above
``datagen.models``: real model code never imports them."""
