"""The `datagen` command line: one sub-command per step, made from the steps' ``Spec`` models.

Each step module under ``datagen.steps`` declares ``HELP``, ``Spec`` (its input), ``Result`` and
``run(spec) -> Result`` (``datagen.steps``). This module turns a ``Spec`` into argparse options
(``add_spec_arguments``; ``datagen.steps._args`` says how a field becomes an option), parses the
command line back into a ``Spec`` and runs the step. ``to_argv`` is the inverse: the command line
that gives a ``Spec``, for the runners that start a step as a program.

The result is printed as the last line of stdout, prefixed with ``datagen-result: `` so a runner
(subprocess or container) can read it. Errors derived from ``DatagenError`` print their message
and hint (no traceback) and exit with the error's code; the codes are in ``datagen.errors``.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import sys
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from datagen.errors import EXIT_FAILED, EXIT_OK, CannotRunHereError, DatagenError, spec_error
from datagen.steps import STEPS, load
from datagen.steps._args import Arg

RESULT_PREFIX = "datagen-result: "


class _Missing:
    """Stands in for a step module that cannot be imported in this environment."""

    def __init__(self, step: str, package: str):
        self.step, self.package = step, package

    def run(self, spec):
        raise CannotRunHereError(
            f"`datagen {self.step}` needs the package {self.package}, which this environment lacks",
            hint="run this step in the steps image or an environment made by `make setup`",
        )


# --- Spec <-> command line --------------------------------------------------------------------

def _arg(field: FieldInfo) -> Arg:
    return next((m for m in field.metadata if isinstance(m, Arg)), Arg())


def _plain(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _option(name: str, field: FieldInfo) -> str:
    return _arg(field).flag or "--" + name.replace("_", "-")


def add_spec_arguments(parser: argparse.ArgumentParser, spec_type: type[BaseModel]) -> None:
    """One argparse argument per field of ``spec_type`` (its dest is the field's name)."""
    for name, field in spec_type.model_fields.items():
        arg = _arg(field)
        kind = _plain(field.annotation)
        kwargs: dict[str, Any] = {"help": arg.help or field.description}
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            if typing.get_origin(kind) in (list, tuple):
                kwargs["nargs"] = "+"
                kind = typing.get_args(kind)[0]
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                kwargs["choices"] = [e.value for e in kind]
            elif typing.get_origin(kind) is Literal:
                kwargs["choices"] = list(typing.get_args(kind))
            elif kind in (int, float):
                kwargs["type"] = kind
            if arg.metavar:
                kwargs["metavar"] = arg.metavar
        if arg.positional:
            parser.add_argument(name, **kwargs)
            continue
        if field.is_required():
            kwargs["required"] = True
        else:
            default = field.get_default(call_default_factory=True)
            kwargs["default"] = default.value if isinstance(default, enum.Enum) else default
        parser.add_argument(_option(name, field), dest=name, **kwargs)


def spec_from_namespace(step: str, spec_type: type[BaseModel], args: argparse.Namespace) -> BaseModel:
    """The ``Spec`` the parsed command line gives (options left out take the field's default)."""
    values = {name: getattr(args, name) for name in spec_type.model_fields if getattr(args, name, None) is not None}
    try:
        return spec_type.model_validate(values)
    except ValidationError as e:
        raise spec_error(e, source="the command line", hint=f"see `datagen {step} --help`") from None


def to_argv(step: str, spec: BaseModel) -> list[str]:
    """The command line (after ``datagen``) that parses into ``spec``: ``[step, ...]``."""
    positional: list[str] = []
    options: list[str] = []
    for name, field in type(spec).model_fields.items():
        value = getattr(spec, name)
        if value is None or (value is False and _plain(field.annotation) is bool):
            continue
        if _arg(field).positional:
            positional.append(_text(value))
        elif value is True:
            options.append(_option(name, field))
        elif isinstance(value, (list, tuple)):
            if value:
                options += [_option(name, field), *(_text(v) for v in value)]
        else:
            options += [_option(name, field), _text(value)]
    if any(p.startswith("-") for p in positional):  # "--": not to be read as an option
        return [step, *options, "--", *positional]
    return [step, *positional, *options]  # before the options: a list option would take them


def _text(value: Any) -> str:
    return str(value.value if isinstance(value, enum.Enum) else value)


# --- the program ------------------------------------------------------------------------------

def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that step's module is imported (a step starts faster)."""
    parser = argparse.ArgumentParser(
        prog="datagen", description="EAGLE-3 hidden-state datasets: extract, check, publish."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="STEP")
    for name, module_name in STEPS.items():
        if only is not None and name != only:
            continue
        try:
            module = load(name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue  # step not built in this version
            # A step whose optional dependency this environment lacks (the extract image has
            # no boto3): the others still work; this one says what is missing.
            p = sub.add_parser(name, help=f"(unavailable here: needs {e.name})")
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(_module=_Missing(name, e.name), _step=name)
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        add_spec_arguments(p, module.Spec)
        p.set_defaults(_module=module, _step=name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    step = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=step if step in STEPS else None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format=f"%(asctime)s {args._step} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    try:
        module = args._module
        spec = None if isinstance(module, _Missing) else spec_from_namespace(args._step, module.Spec, args)
        result = module.run(spec)
    except DatagenError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    record = result.model_dump(mode="json", fallback=str)  # as json.dumps(default=str) did
    print(RESULT_PREFIX + json.dumps(record, sort_keys=True, default=str), flush=True)
    return EXIT_FAILED if record.get("failed") else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
