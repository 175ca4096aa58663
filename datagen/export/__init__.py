"""Export: a validated dataset written out in a training framework's own layout.

``speculators.py`` writes what speculators 0.9's trainer reads (``datagen export --format
speculators``). It reads the shards through validation's checked reader (every shard's sha256
and header checked as it is read), so it sits on a floor above validation; the step
``datagen/steps/export.py`` is its command line.
"""
