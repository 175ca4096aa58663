"""How a step's ``Spec`` appears on the command line.

A step's input is a pydantic model, ``Spec``; the `datagen` command line is made from it
(``datagen.cli``): one option per field, named ``--field-name``, its help the field's
description, its choices the field's enum or Literal, ``store_true`` for a bool, ``nargs="+"``
for a list. ``Arg`` says where a field departs from that: a positional argument, another option
name, a metavar, a help text with argparse's ``%(default)s``, or how the option's text becomes
the field's value.

A spec that is a domain model (plan, extract and assemble: ``datagen.specs.extraction.ExtractSpec`` and
what the step adds) is read whole from ``--spec FILE`` (``SPEC_FILE``); the options given on the
command line override the file's values. Its nested settings (``engine``) have options only where
``OPTIONS`` names them, as ``"engine.dtype"``; ``OPTIONS`` also gives the form of a field the
domain model declares, whose own module cannot name an ``Arg``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class Arg:
    """A field's command-line form, where it is not the default ``--field-name``."""

    flag: str | None = None  # the option's name (the field stays the argparse dest)
    positional: bool = False  # a positional argument, in field order
    metavar: str | None = None
    help: str | None = None  # instead of the description, e.g. with "%(default)s"
    parse: Callable[[str], Any] | None = None  # option text -> value; raises SpecError naming the option


class StepSpec(BaseModel):
    """Base of every step's ``Spec``: what its command line says, nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # True: `--spec FILE` holds the whole spec as JSON, and the options given override it.
    SPEC_FILE: ClassVar[bool] = False
    # field path ("layer_ids", "engine.dtype") -> its option, for fields the step's own module does not declare
    OPTIONS: ClassVar[Mapping[str, Arg]] = {}
