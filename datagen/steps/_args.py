"""How a step's ``Spec`` appears on the command line.

A step's input is a pydantic model, ``Spec``; the `datagen` command line is made from it
(``datagen.cli``): one option per field, named ``--field-name``, its help the field's
description, its choices the field's enum or Literal, ``store_true`` for a bool, ``nargs="+"``
for a list. ``Arg`` says where a field departs from that: a positional argument, another option
name, a metavar, or a help text with argparse's ``%(default)s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class Arg:
    """A field's command-line form, where it is not the default ``--field-name``."""

    flag: str | None = None  # the option's name (the field stays the argparse dest)
    positional: bool = False  # a positional argument, in field order
    metavar: str | None = None
    help: str | None = None  # instead of the description, e.g. with "%(default)s"


class StepSpec(BaseModel):
    """Base of every step's ``Spec``: what its command line says, nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True)
