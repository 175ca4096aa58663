"""Which pinned packages of requirements/lock.txt go into an image.

An image installs the packages reachable from its roots (the project's dependencies plus
the names in ``images/<image>/requirements.in``), each at the version the lock pins, and
nothing else: the steps image leaves out vLLM and everything only vLLM needs.

The dependency edges come from the metadata of the development environment, which
``make setup`` installs from the same lock (so the two agree; ``closure`` checks it).
A requirement on a package the lock does not pin is skipped: the lock leaves some out
on purpose (torchvision, torchaudio, torchcodec break ``import transformers`` next to
the CPU torch).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import NormalizedName, canonicalize_name

from datagen.errors import SpecError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pin:
    """One line of the lock."""

    name: NormalizedName  # canonical name ("typing-extensions")
    line: str  # the line as written ("typing_extensions==4.16.0")
    version: str  # "4.16.0"


def read_lock(path: Path) -> dict[NormalizedName, Pin]:
    """The lock's pins by canonical name.

    Raises:
        SpecError: a line is not ``name==version``.
    """
    pins: dict[NormalizedName, Pin] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            raise SpecError(f"{path}:{number}: not a requirement: {raw!r}") from e
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise SpecError(
                f"{path}:{number}: {raw!r} is not pinned with ==",
                hint="every line of the lock pins one exact version",
            )
        name = canonicalize_name(req.name)
        pins[name] = Pin(name=name, line=line, version=specs[0].version)
    return pins


def project_dependencies(pyproject: Path) -> list[Requirement]:
    """The ``[project].dependencies`` of a pyproject.toml."""
    data = tomllib.loads(pyproject.read_text())
    return [Requirement(r) for r in data["project"].get("dependencies", [])]


def read_requirements_in(path: Path) -> list[Requirement]:
    """Names (with optional extras and markers) from a requirements.in; comments ignored."""
    lines = (raw.split("#", 1)[0].strip() for raw in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def closure(
    roots: Iterable[Requirement],
    pins: dict[NormalizedName, Pin],
    *,
    provided: Iterable[str] = (),
) -> list[Pin]:
    """The pins reachable from ``roots``, sorted by name.

    Args:
        roots: what the image needs directly.
        pins: the lock (``read_lock``).
        provided: packages the base image already has: they, and everything reachable only
            through them, are left out.

    Raises:
        SpecError: a root is not in the lock, or the environment disagrees with the lock
            (run ``make setup``).
    """
    env = default_environment()
    stop = {canonicalize_name(n) for n in provided}
    stop |= _reachable([Requirement(n) for n in stop], pins, env, stop=set()) if stop else set()
    roots = list(roots)
    for req in roots:
        if canonicalize_name(req.name) not in pins:
            raise SpecError(
                f"{req.name} is not pinned in the lock",
                hint="add it to requirements/base.in and regenerate requirements/lock.txt",
            )
    names = _reachable(roots, pins, env, stop=stop)
    return [pins[n] for n in sorted(names)]


def _reachable(
    roots: list[Requirement], pins: dict[NormalizedName, Pin], env: dict, *, stop: set
) -> set[NormalizedName]:
    seen: dict[NormalizedName, set[str]] = {}  # name -> extras already expanded
    queue = [(r, {""}) for r in roots]
    while queue:
        req, parent_extras = queue.pop()
        name = canonicalize_name(req.name)
        if name in stop:
            continue
        if req.marker is not None and not any(
            req.marker.evaluate({**env, "extra": e}) for e in parent_extras
        ):
            continue
        if name not in pins:
            logger.debug("%s: not in the lock, left out", req)
            continue
        extras = {""} | {canonicalize_name(e) for e in req.extras}
        new = extras - seen.get(name, set())
        if not new:
            continue
        seen.setdefault(name, set()).update(new)
        queue.extend((dep, new) for dep in _requires(pins[name]))
    return set(seen)


@functools.cache  # metadata look-ups scan sys.path; a pin's requirements never change
def _requires(pin: Pin) -> tuple[Requirement, ...]:
    try:
        dist = importlib.metadata.distribution(pin.name)
    except importlib.metadata.PackageNotFoundError as e:
        raise SpecError(
            f"{pin.line} is in the lock but not installed in this environment",
            hint="run `make setup` (it installs requirements/lock.txt)",
        ) from e
    if canonicalize_name(dist.version) != canonicalize_name(pin.version):
        raise SpecError(
            f"{pin.name} {dist.version} is installed but the lock pins {pin.version}",
            hint="run `make setup` (it installs requirements/lock.txt)",
        )
    return tuple(Requirement(r) for r in dist.requires or [])
