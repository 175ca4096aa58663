"""Every error the datagen steps raise.

Each error subclasses the standard exception a caller already catches, carries
its context as attributes, and says what to do next. Each error also carries an
exit code: the orchestration layer reads the code to decide whether a step is
worth retrying (``EXIT_TRANSIENT``) or must fail at once (everything else).
"""

from __future__ import annotations

# Exit codes of every `datagen` command. Orchestration retries only EXIT_TRANSIENT.
EXIT_OK = 0
EXIT_FAILED = 1  # an unexpected crash (a bug): not retried blindly
EXIT_BAD_INPUT = 2  # the spec, the dataset or the model is wrong: fix the input
EXIT_CANNOT_RUN_HERE = 3  # this machine cannot run the spec (no GPU, untested engine)
EXIT_VALIDATION = 4  # the data failed validation
EXIT_TRANSIENT = 75  # EX_TEMPFAIL: try again (network, storage, a killed worker)


class DatagenError(Exception):
    """Base class. ``exit_code`` tells the orchestrator what kind of failure this is."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message}\n  -> {hint}" if hint else message)


class SpecError(DatagenError, ValueError):
    """The spec (command-line options or spec file) is invalid."""

    exit_code = EXIT_BAD_INPUT


def spec_error(error, *, source: str, hint: str) -> SpecError:
    """One SpecError naming every field a pydantic ``ValidationError`` found wrong.

    Args:
        error: the ``pydantic.ValidationError``.
        source: what was parsed, for the message ("spec.json", "the command line").
        hint: what to do (where the fields are documented).
    """
    lines = [f"{'.'.join(str(x) for x in err['loc']) or '(root)'}: {err['msg']}" for err in error.errors()]
    return SpecError(f"{source} is invalid:\n    " + "\n    ".join(lines), hint=hint)


class DatasetError(DatagenError, ValueError):
    """A dataset row cannot be read. ``line`` is 1-based."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, path: str, line: int | None = None, hint: str | None = None):
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}", hint=hint)


class ModelError(DatagenError, ValueError):
    """The model directory is missing, incomplete or of an unsupported architecture."""

    exit_code = EXIT_BAD_INPUT


class ModelNotFoundError(ModelError, FileNotFoundError):
    """The model directory or one of its files does not exist."""


class OutputConflictError(DatagenError, FileExistsError):
    """The output directory holds a dataset of another spec."""

    exit_code = EXIT_BAD_INPUT


class EngineSettingError(DatagenError, ValueError):
    """vLLM refuses a setting of the engine (an engine option or a ``VLLM_*`` variable).
    ``settings`` names it, as ``name=value``; the message carries vLLM's own reason."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, settings: list[str], hint: str | None = None):
        self.settings = settings
        super().__init__(message, hint=hint)


class EngineUnsupportedError(DatagenError, RuntimeError):
    """The installed engine (vLLM) is outside the tested range or cannot capture here."""

    exit_code = EXIT_CANNOT_RUN_HERE


class CannotRunHereError(DatagenError, RuntimeError):
    """This machine cannot run the spec (not enough GPUs, no space, missing engine)."""

    exit_code = EXIT_CANNOT_RUN_HERE


class TransientError(DatagenError, RuntimeError):
    """A fault that may go away on retry (storage, network, a killed process)."""

    exit_code = EXIT_TRANSIENT


class StorageError(TransientError, OSError):
    """Reading or writing the output store failed for a reason that may pass."""


class ValidationFailed(DatagenError, ValueError):
    """A dataset failed validation. ``problems`` lists each one."""

    exit_code = EXIT_VALIDATION

    def __init__(self, message: str, *, problems: list | None = None, hint: str | None = None):
        self.problems = problems or []
        super().__init__(message, hint=hint)


class UnsafePathError(DatagenError, ValueError):
    """A manifest or spec names a path that escapes its dataset directory."""

    exit_code = EXIT_BAD_INPUT
