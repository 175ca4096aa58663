"""The steps: one module per `datagen` command.

Each step module declares its contract once:

    HELP: str                      one line for `datagen --help`
    class Spec(StepSpec)           its input: one field per command-line option (datagen.steps._args)
    class <Name>Result(BaseModel)  its result: the JSON record after the result prefix; ``Result``
                                   names it (PlanResult, ExtractResult, DownloadResult, ...)
    def run(spec: Spec) -> Result  does the step

A step reads its input, does the work through the floors below (extraction, engines, storage,
data, models, validation) and returns its result; the command line (``datagen.cli``) prints it,
and the orchestration parses it back with ``result_type``. Nothing below imports a step.

The modules are imported lazily (``load``): the extract step needs vLLM, publish needs boto3, and
an image holds only what its steps need.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pydantic import BaseModel

# command name -> module. The same step name is used for module, task, image and log lines.
STEPS: dict[str, str] = {
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
    "regenerate": "datagen.steps.regenerate",
    "train": "datagen.steps.train",
    "measure-draft": "datagen.steps.measure_draft",
}


def load(step: str) -> ModuleType:
    """The step's module.

    Raises:
        KeyError: no step of that name.
        ModuleNotFoundError: the step, or a package it needs, is not installed here.
    """
    return importlib.import_module(STEPS[step])


def result_type(step: str) -> type[BaseModel]:
    """The step's result model (what its result line parses into)."""
    return load(step).Result
