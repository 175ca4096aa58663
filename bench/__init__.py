"""Benchmarks: ``make bench`` (``python -m bench.run``) measures where the time goes.

One module per figure, each runnable alone (``python -m bench.<module> --mode smoke``) and each
writing one JSON record; ``bench.report`` turns the records into the table and the plots.
docs/performance.md explains every figure. ``bench/gpu/`` is the H200 counterpart of figure 1.
"""
