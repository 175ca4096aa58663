"""The `datagen` command line: one sub-command per step, made from the steps' ``Spec`` models.

Each step module under ``datagen.steps`` declares ``HELP``, ``Spec`` (its input), ``Result`` and
``run(spec) -> Result`` (``datagen.steps``). This module turns a ``Spec`` into argparse options
(``add_spec_arguments``; ``datagen.steps._args`` says how a field becomes an option), parses the
command line back into a ``Spec`` and runs the step. A runner that starts a step as a program
passes its ``Spec`` whole, as the JSON file of ``--spec`` (a step whose ``Spec`` is read from one,
``StepSpec.SPEC_FILE``).

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
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from datagen.specs.extraction import read_spec_file
from datagen.errors import EXIT_FAILED, EXIT_OK, CannotRunHereError, DatagenError, SpecError, spec_error
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

SPEC_FILE_DEST = "spec_file"


@dataclass(frozen=True)
class _Option:
    """One option of a step: the field it sets (``path``, dotted for a nested setting)."""

    path: str
    field: FieldInfo
    arg: Arg

    @property
    def dest(self) -> str:
        return self.path.replace(".", "__")


def _arg(field: FieldInfo) -> Arg:
    return next((m for m in field.metadata if isinstance(m, Arg)), Arg())


def _plain(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _is_model(annotation: Any) -> bool:
    kind = _plain(annotation)
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _options(spec_type: type[BaseModel]) -> list[_Option]:
    """The step's options: its own fields (a nested model's only where ``OPTIONS`` names them)."""
    named: dict = dict(getattr(spec_type, "OPTIONS", {}))
    out = []
    for name, field in spec_type.model_fields.items():
        arg = named.get(name) or _arg(field)
        if _is_model(field.annotation) and arg.parse is None:  # nested settings (a parsed one: an option)
            sub = _plain(field.annotation)
            out += [_Option(path, sub.model_fields[path.split(".", 1)[1]], a)
                    for path, a in named.items() if path.startswith(name + ".")]
        else:
            out.append(_Option(name, field, arg))
    return out


def add_spec_arguments(parser: argparse.ArgumentParser, spec_type: type[BaseModel]) -> None:
    """One argparse argument per option of ``spec_type`` (its dest the field's path, ``.`` as ``__``)."""
    from_file = getattr(spec_type, "SPEC_FILE", False)
    if from_file:
        parser.add_argument("--spec", dest=SPEC_FILE_DEST, metavar="FILE",
                            help="spec JSON file: the whole spec (the options given here override it)")
    for opt in _options(spec_type):
        field, arg = opt.field, opt.arg
        kind = _plain(field.annotation)
        kwargs: dict[str, Any] = {"help": arg.help or field.description}
        if arg.parse is not None:
            kwargs["metavar"] = arg.metavar or opt.path.split(".")[-1].upper()
        elif kind is bool:  # an optional bool left unset (None) can be set either way: --x / --no-x
            kwargs["action"] = argparse.BooleanOptionalAction if field.default is None else "store_true"
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
            if arg.metavar or "choices" not in kwargs:
                kwargs["metavar"] = arg.metavar or opt.path.split(".")[-1].upper()
        if arg.positional:
            if from_file:  # the file may give it
                kwargs.update(nargs="?", default=None, metavar=opt.dest.upper())
            parser.add_argument(opt.dest, **kwargs)
            continue
        if from_file:  # the file may give it: an option left out sets nothing
            kwargs["default"] = None
        elif field.is_required():
            kwargs["required"] = True
        else:
            default = field.get_default(call_default_factory=True)
            kwargs["default"] = default.value if isinstance(default, enum.Enum) else default
        parser.add_argument(arg.flag or "--" + opt.path.split(".")[-1].replace("_", "-"), dest=opt.dest, **kwargs)


def spec_from_namespace(step: str, spec_type: type[BaseModel], args: argparse.Namespace) -> BaseModel:
    """The ``Spec`` the parsed command line gives (options left out take the field's default, or
    the ``--spec`` file's value)."""
    from_file = getattr(spec_type, "SPEC_FILE", False)
    path = getattr(args, SPEC_FILE_DEST, None) if from_file else None
    raw: dict[str, Any] = read_spec_file(path, docs=f"`datagen {step} --help`") if path else {}
    for name, field in spec_type.model_fields.items():  # nested settings: an object, or left out
        if name in raw and _is_model(field.annotation):
            _object(raw[name], name, path)
    for opt in _options(spec_type):
        value = getattr(args, opt.dest, None)
        if value is None:
            continue
        if opt.arg.parse is not None:
            value = opt.arg.parse(value)
        *parents, leaf = opt.path.split(".")
        target = raw
        for parent in parents:
            target[parent] = dict(_object(target.get(parent), parent, path))
            target = target[parent]
        target[leaf] = value
    if from_file:
        flags = {o.path: o.dest.upper() if o.arg.positional else o.arg.flag or "--" + o.path.replace("_", "-")
                 for o in _options(spec_type)}
        missing = [flags.get(n, n) for n, f in spec_type.model_fields.items() if f.is_required() and raw.get(n) in (None, "")]
        if missing:
            raise SpecError(f"missing {', '.join(missing)}", hint=f"see `datagen {step} --help`")
    try:
        return spec_type.model_validate(raw)
    except ValidationError as e:
        flags = {o.path: o.arg.flag or "--" + o.path.split(".")[-1].replace("_", "-")
                 for o in _options(spec_type) if not o.arg.positional}
        named = {".".join(str(x) for x in err["loc"][:n]) for err in e.errors() for n in (1, 2)}
        aka = "; ".join(f"{p} is the option {flags[p]}" for p in sorted(named & set(flags)))
        raise spec_error(e, source=path or "the command line",
                         hint=f"fix the fields named above{f' ({aka})' if aka else ''} (unknown fields are refused; "
                              f"see `datagen {step} --help`)") from None


def _object(value: Any, name: str, path: str | None) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{path or 'the spec'}: {name} must be an object, got {type(value).__name__}",
                        hint=f'write e.g. "{name}": {{"name": "vllm", "tensor_parallel_size": 8}}')
    return value


# --- the program ------------------------------------------------------------------------------

def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that step's module is imported (a step starts faster)."""
    parser = argparse.ArgumentParser(
        prog="datagen", description="EAGLE-3 hidden-state datasets: extract, check, publish."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="STEP")
    for name in STEPS:
        if only is not None and name != only:
            continue
        try:
            module = load(name)
        except ModuleNotFoundError as e:
            # A step whose optional dependency this environment lacks (the extract image has
            # no boto3): the others still work; this one says what is missing.
            p = sub.add_parser(name, help=f"(unavailable here: needs {e.name})")
            # its options are unknown here: whatever was given, the error says what is missing
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
    args, unknown = parser.parse_known_args(argv)
    if unknown and not isinstance(getattr(args, "_module", None), _Missing):
        parser.parse_args(argv)  # argparse's own error (exit 2) for what no step takes
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
    # one write of the whole line: the ranks of a torchrun share one stdout, and print() writes the
    # text and its newline apart, so two ranks' lines could run together
    sys.stdout.flush()
    sys.stdout.write(RESULT_PREFIX + json.dumps(record, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
    return EXIT_FAILED if record.get("failed") else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
