"""The `datagen` command line: one sub-command per step.

Each step module under ``datagen.steps`` exposes:

    HELP: str                                   one line for `datagen --help`
    def add_arguments(parser) -> None           its options (argparse)
    def main(args) -> dict                      runs the step, returns its result record

The result record is printed as the last line of stdout, prefixed with
``datagen-result: `` so a runner (subprocess or container) can read it. Errors
derived from ``DatagenError`` print their message and hint (no traceback) and
exit with the error's code; the codes are in ``datagen.errors``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from datagen.errors import EXIT_FAILED, EXIT_OK, CannotRunHereError, DatagenError

# command name -> module. The same step name is used for module, task, image and log lines.
STEPS = {
    "plan": "datagen.steps.plan",
    "extract": "datagen.steps.extract",
    "assemble": "datagen.steps.assemble",
    "env-check": "datagen.steps.env_check",
    "download": "datagen.steps.download",
    "validate": "datagen.steps.validate",
    "publish": "datagen.steps.publish",
    "export": "datagen.steps.export",
    "report": "datagen.steps.report",
    "make-tiny": "datagen.steps.make_tiny",
}
RESULT_PREFIX = "datagen-result: "


class _Missing:
    """Stands in for a step module that cannot be imported in this environment."""

    def __init__(self, step: str, package: str):
        self.step, self.package = step, package

    def main(self, args):
        raise CannotRunHereError(
            f"`datagen {self.step}` needs the package {self.package}, which this environment lacks",
            hint="run this step in the steps image or an environment made by `make setup`",
        )


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
            module = importlib.import_module(module_name)
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
        module.add_arguments(p)
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
        result = args._module.main(args)
    except DatagenError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    print(RESULT_PREFIX + json.dumps(result or {}, sort_keys=True, default=str), flush=True)
    return EXIT_OK if result is None or not result.get("failed") else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
