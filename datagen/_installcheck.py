"""Fails `make setup` when the environment holds packages that break the CPU engine.

torchvision, torchaudio and torchcodec from PyPI are built against another torch and make
`import transformers` fail next to the CPU torch. They must never be installed.
"""

import importlib.util
import sys

FORBIDDEN = ("torchvision", "torchaudio", "torchcodec")


def main() -> int:
    present = [name for name in FORBIDDEN if importlib.util.find_spec(name) is not None]
    if present:
        print(
            f"error: {', '.join(present)} installed; they break `import transformers` next to the "
            f"CPU torch. Run: .venv/bin/pip uninstall -y {' '.join(present)}",
            file=sys.stderr,
        )
        return 1
    import transformers  # noqa: F401  (the import that those packages break)

    return 0


if __name__ == "__main__":
    sys.exit(main())
