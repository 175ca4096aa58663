"""The steps: one module per `datagen` command (plan, extract, assemble, env-check, download,
validate, publish, export, report, make-tiny). A step module reads its input, does the work through
the floors below (engines, storage, data, models, validation) and returns its result record; the
command line (``datagen.cli``) is the only caller that prints it. Nothing below imports a step.
"""
