"""The import picture (docs/architecture.md): inside datagen/ no import runs back up a floor, and
datagen/ imports neither the orchestration (tasks, flows) nor Prefect."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _picture():
    spec = importlib.util.spec_from_file_location("import_picture", ROOT / "scripts" / "import_picture.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_picture", module)
    spec.loader.exec_module(module)
    return module


def test_no_import_inside_datagen_runs_back_up_a_floor():
    picture = _picture()
    up = [(a, b) for (a, b) in picture.arrows()
          if a.startswith("datagen") and picture.floor(b) <= picture.floor(a)]
    assert up == []


def test_datagen_imports_no_orchestration():
    picture = _picture()
    found = set()
    for path in (ROOT / "datagen").rglob("*.py"):
        for mod in picture.imports(path):
            if mod.split(".")[0] in ("tasks", "flows", "prefect"):
                found.add((str(path.relative_to(ROOT)), mod))
    assert found == set()


def test_every_datagen_folder_is_on_a_floor():
    picture = _picture()
    folders = {f"datagen.{p.name}" for p in (ROOT / "datagen").iterdir() if (p / "__init__.py").exists()}
    placed = {part for floor in picture.FLOORS for part in floor}
    assert folders <= placed
