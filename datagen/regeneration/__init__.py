"""Regeneration: the target model writes the assistant turns of a chat dataset before extraction.

An EAGLE-3 draft learns to predict its target, so its training chats should carry the target's
own answers. ``datagen regenerate`` (its work is ``run.py``) reads a JSONL of chats and
writes a dataset directory whose ``chats.jsonl`` extraction reads like any dataset:

    settings.py   what a regeneration is asked to do (sampling, policies, chunks): its fingerprint
    chats.py      turn by turn: which turns are generated, kept or skipped; a row's state
    generator.py  vLLM offline generation (the CPU build here, CUDA and tensor parallel in production)
    reasoning.py  a thinking model's reasoning split into ``reasoning_content`` (vLLM's parsers)
    rounds.py     a chunk of rows generated in rounds on a started engine
    output.py     the chunk files (the unit of resume), the output files and the manifest
    run.py        the whole regeneration in order (``regenerate``): inputs checked, chunks, manifest

docs/regeneration.md describes the whole step.
"""
