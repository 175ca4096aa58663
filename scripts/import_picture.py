"""The import picture: which parts of the project import which, read from the code's own imports.

    python scripts/import_picture.py          # the floors and their arrows (docs/architecture.md)
    python scripts/import_picture.py --check  # exit 1 if an arrow runs back up

A part is a top-level package (``tasks``, ``flows``, ``bench``, ``images``) or a folder of
``datagen`` (``datagen.steps``, ``datagen.data``, ...; ``datagen.errors`` and ``datagen.settings``
are the part ``datagen`` itself, with ``cli``). Every import counts, also those inside functions.
``FLOORS`` is the intended order, top first; an arrow from a part to one on a higher floor, or
between two parts of one floor, is an arrow back up.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("datagen", "tasks", "flows", "bench", "images")

# top first; parts on one floor must not import each other
FLOORS = [
    ["bench"],
    ["flows"],
    ["tasks"],
    ["images"],
    ["datagen.cli"],
    ["datagen.steps"],
    ["datagen.export"],  # reads the shards through validation's checked reader
    ["datagen.training", "datagen.validation"],  # validation's layer report reads a manifest through the reader's store
    ["datagen.reader", "datagen.regeneration", "datagen.envcheck"],
    ["datagen.extraction"],
    ["datagen.engines", "datagen.testmodels"],  # the generated checkpoints: real model code never imports them
    ["datagen.storage"],  # the download checks what it fetched with models' modelinfo
    ["datagen.models", "datagen.specs"],  # the spec: records of what to extract and its plan, no model code
    ["datagen.data"],
    ["datagen"],  # errors, settings
]


def part_of(module: str) -> str | None:
    """The part a dotted module name belongs to, or None outside the project."""
    bits = module.split(".")
    if bits[0] not in PACKAGES:
        return None
    if bits[0] != "datagen" or len(bits) == 1:
        return bits[0]
    if bits[1] in ("cli", "__main__"):
        return "datagen.cli"
    if (ROOT / "datagen" / bits[1]).is_dir():
        return f"datagen.{bits[1]}"
    return "datagen"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from datagen import s3`
    return out


def arrows() -> dict[tuple[str, str], int]:
    """(importer part, imported part) -> number of modules with such an import."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            src = part_of(module_name(path))
            for mod in imports(path):
                dst = part_of(mod)
                if dst is None or dst == src:
                    continue
                found[(src, dst)].add(module_name(path))
    return {k: len(v) for k, v in found.items()}


def floor(part: str) -> int:
    for i, parts in enumerate(FLOORS):
        if part in parts:
            return i
    raise KeyError(f"{part} is on no floor: add it to FLOORS")


def main(argv: list[str]) -> int:
    found = arrows()
    up = [(a, b) for (a, b) in found if floor(b) <= floor(a)]
    for parts in FLOORS:
        for p in parts:
            targets = sorted({b for (a, b) in found if a == p}, key=floor)
            print(f"{p:20} -> {', '.join(targets) if targets else '(nothing)'}")
    if up:
        print("\narrows back up (importer -> imported, modules):")
        for a, b in sorted(up):
            print(f"  {a} -> {b} ({found[(a, b)]})")
    else:
        print("\nno arrow back up")
    return 1 if (up and "--check" in argv) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
