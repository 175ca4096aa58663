"""requirements/lock-cuda.txt, all packages of the CUDA extract image: `python -m images.lock_cuda`.

The CUDA image built from wheels alone (``datagen-extract-cuda``) installs this whole lock with
``--no-deps``, like the development environment installs requirements/lock.txt: no resolver runs
at build time and no index is used. This script is the resolver, run by hand when a root moves
(a new vLLM release in ``datagen/engines/releases.py``, a new project dependency): it resolves

    the project's [project].dependencies
    + images/extract/requirements-cuda.in
    + vllm==<CUDA_VLLM_RELEASE>

for CPython 3.11 on manylinux x86_64 (the offline Debian bookworm base) with ``pip download``
from the package index, writes the lock, and leaves the downloaded wheels in the wheelhouse
(``.cache/wheelhouse/cp311/``) that images/build.py builds from. vLLM pins its torch exactly
(``torch==2.11.0`` for 0.24.0) and the index's default build of that torch is the CUDA build
vLLM's wheel is compiled against, so the lock gets CUDA torch and its ``nvidia-*`` runtime wheels.

``check_lock`` (run by ``images.tags.plan_image``, no network) says when the lock no longer
matches its roots.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `images` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from datagen.engines.releases import CUDA_VLLM_RELEASE
from datagen.errors import CannotRunHereError, SpecError
from images.paths import ROOT, WHEELHOUSE
from images.requirements import Pin, project_dependencies, read_lock, read_requirements_in

LOCK = "requirements/lock-cuda.txt"
ROOTS_IN = "images/extract/requirements-cuda.in"
PYTHON = "3.11"  # Debian bookworm's Python: the offline base's
# The newest glibc the base has (bookworm: 2.36). pip does not widen a given manylinux tag to
# older glibc versions, so every tag the base accepts is passed.
PLATFORM = "manylinux_2_36_x86_64"
PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)
REGENERATE = "python -m images.lock_cuda"
# The CUDA runtime wheel whose version the image's label reports (CUDA 13: no -cu1x suffix).
CUDA_RUNTIME = canonicalize_name("nvidia-cuda-runtime")


def roots(root: Path) -> list[Requirement]:
    """What the CUDA image needs directly."""
    reqs = project_dependencies(root / "pyproject.toml")
    reqs += read_requirements_in(root / ROOTS_IN)
    return reqs + [Requirement(f"vllm=={CUDA_VLLM_RELEASE}")]


def check_lock(root: Path) -> dict[str, Pin]:
    """The CUDA lock's pins, after checking that every root is pinned at a version it allows.

    Raises:
        SpecError: the lock is missing, or a root is unpinned or pinned outside its range
            (the hint gives the command that regenerates the lock).
    """
    path = root / LOCK
    if not path.exists():
        raise SpecError(f"{LOCK} does not exist", hint=f"generate it: {REGENERATE}")
    pins = read_lock(path)
    for req in roots(root):
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            raise SpecError(f"{LOCK} does not pin {req.name}", hint=f"regenerate it: {REGENERATE}")
        if not req.specifier.contains(pin.version, prereleases=True):
            raise SpecError(
                f"{LOCK} pins {pin.line}, outside {req} (from {_origin(req)})",
                hint=f"regenerate it: {REGENERATE}",
            )
    return pins


def cuda_version(pins: dict[str, Pin]) -> str:
    """"13.0" from the lock's nvidia-cuda-runtime pin (what torch.version.cuda says)."""
    pin = pins.get(CUDA_RUNTIME)
    if pin is None:
        raise SpecError(f"{LOCK} pins no {CUDA_RUNTIME}", hint=f"regenerate it: {REGENERATE}")
    return ".".join(pin.version.split(".")[:2])


def _origin(req: Requirement) -> str:
    if canonicalize_name(req.name) == "vllm":
        return "datagen/engines/releases.py"
    return "pyproject.toml or " + ROOTS_IN


def pip_env() -> dict[str, str]:
    """The environment without the host's pip configuration (extra indexes, local wheel
    folders, constraints): the lock must come from the package index alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    for keep in ("PIP_INDEX_URL", "PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_CLIENT_CERT"):
        if keep in os.environ:
            env[keep] = os.environ[keep]
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def resolve(root: Path, wheelhouse: Path) -> list[Path]:
    """Resolves the roots from the index; returns the chosen wheels, moved into ``wheelhouse``.

    Wheels already in ``wheelhouse`` are offered to the resolver (``--find-links``) so a
    re-run downloads only what changed.
    """
    # pip evaluates the target's Python version, but the host's platform markers (torch's CUDA
    # wheels are `platform_system == "Linux"`): elsewhere the lock would silently lack them.
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        raise CannotRunHereError(
            f"the CUDA lock is resolved for Linux x86_64; this host is "
            f"{platform.system()} {platform.machine()}",
            hint="run `python -m images.lock_cuda` on a Linux x86_64 host",
        )
    wheelhouse.mkdir(parents=True, exist_ok=True)
    # On the wheelhouse's file system, so the wheels are moved, not copied.
    with tempfile.TemporaryDirectory(prefix="lock-cuda-", dir=wheelhouse.parent) as tmp:
        reqs = Path(tmp) / "roots.txt"
        reqs.write_text("".join(f"{r}\n" for r in roots(root)))
        chosen = Path(tmp) / "wheels"
        cmd = [sys.executable, "-m", "pip", "download", "--no-cache-dir", "--progress-bar", "off"]
        cmd += ["--only-binary=:all:", "--find-links", str(wheelhouse), "-d", str(chosen)]
        cmd += ["--python-version", PYTHON, "--implementation", "cp"]
        cmd += ["--abi", "cp" + PYTHON.replace(".", ""), "--abi", "abi3", "--abi", "none"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        cmd += ["-r", str(reqs)]
        done = subprocess.run(cmd, env=pip_env(), capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.splitlines()[-20:])
            raise CannotRunHereError(
                f"resolving the CUDA image's packages failed:\n{tail}",
                hint="check that the package index is reachable; a conflict names the roots",
            )
        wheels = []
        for wheel in sorted(chosen.glob("*.whl")):
            target = wheelhouse / wheel.name
            if not target.exists():
                shutil.move(wheel, target)
            wheels.append(target)
    return wheels


def lock_text(wheels: list[Path]) -> str:
    names = (parse_wheel_filename(wheel.name) for wheel in wheels)
    lines = sorted(f"{name}=={version}" for name, version, _, _ in names)
    header = (
        "# The CUDA extract image (datagen-extract-cuda): every package, pinned; installed\n"
        "# with --no-deps from the wheelhouse. Made by `python -m images.lock_cuda`; do not edit.\n"
        f"# pyproject.toml's dependencies + {ROOTS_IN} + vllm=={CUDA_VLLM_RELEASE}\n"
        f"# (datagen/engines/releases.py), for CPython {PYTHON} on {PLATFORM}.\n"
    )
    return header + "".join(line + "\n" for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.split("\n")[0])
    parser.add_argument("--wheelhouse", type=Path, default=WHEELHOUSE / "cp311")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        wheels = resolve(ROOT, args.wheelhouse)
    except CannotRunHereError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    (ROOT / LOCK).write_text(lock_text(wheels))
    check_lock(ROOT)
    size = sum(w.stat().st_size for w in wheels)
    print(
        f"{LOCK}: {len(wheels)} pins, {size / 1e9:.2f} GB of wheels in {args.wheelhouse} "
        f"({time.monotonic() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
