"""The package layout shows the design (DESIGN.md "Package layout"): imports point one way, with no circles.

Every import counts, wherever it stands: at the top of a module, inside a function, or under TYPE_CHECKING.
A circle hidden inside a function is still a circle, and the rules below are about what a part may know.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rolloutpipe"

ALLOWED = {
    "rolloutpipe": set(),
    "types": set(),
    "model": set(),
    "control": {"types", "model"},
    "observe": {"types", "control"},
    "rollout": {"types", "model", "config", "control", "observe"},
    "trainer": {"types", "model", "config", "control", "observe"},
    "config": {"types", "model", "control", "observe", "rollout", "trainer", "launch"},
    "pipeline": {"types", "model", "config", "control", "observe", "rollout", "trainer"},
    "launch": {"types", "model", "config", "control", "observe", "rollout", "trainer", "pipeline"},
    "sim": {"rolloutpipe", "types", "model", "config", "control", "observe", "rollout", "trainer"},
}
"""What each part of the package may import besides itself: types and model at the bottom, control (the plane
between the node groups) above them, observe above control, the two node groups side by side, never importing
each other, and pipeline, launch and the simulator on top. config.py binds the component config modules that
live beside each component (rollout/config.py, trainer/config.py, launch/config.py, ...) and the node groups
read it; the circle check keeps those config modules from importing anything that imports config."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, source: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """The package's modules that module ``name`` imports, anywhere in its ``source`` (``from a import b``: a.b
    if that is a module, else a)."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path.read_text(), set(mods), is_package=path.name == "__init__.py")
            for name, path in mods.items()}


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (circle := visit(m)):
            return circle
    return None


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} imports {dep}" for m, deps in sorted(graph.items()) for dep in sorted(deps)
            if area(dep) != area(m) and area(dep) not in ALLOWED[area(m)]]


def test_no_module_import_circle():
    assert find_circle(import_graph()) is None


def test_rollout_and_trainer_never_import_each_other_and_every_part_imports_only_below_it():
    graph = import_graph()
    assert set(map(area, graph)) <= set(ALLOWED), "a new part of the package: give it a row in ALLOWED"
    assert layering_violations(graph) == []


def test_the_guards_see_a_circle_a_hidden_import_and_a_cross_import():
    graph = import_graph()
    planted = {**graph, "rolloutpipe.config": graph["rolloutpipe.config"] | {"rolloutpipe.pipeline"}}
    assert find_circle(planted) is not None
    planted = "def late():\n    from rolloutpipe.trainer import grpo\n    from ..trainer.batching import BatchConsumer\n"
    hidden = imports_of("rolloutpipe.rollout.planted", planted, set(graph))
    assert hidden == {"rolloutpipe.trainer.grpo", "rolloutpipe.trainer.batching"}
    assert layering_violations({**graph, "rolloutpipe.rollout.planted": hidden}) == [
        "rolloutpipe.rollout.planted imports rolloutpipe.trainer.batching",
        "rolloutpipe.rollout.planted imports rolloutpipe.trainer.grpo"]


def test_the_top_level_holds_few_modules_and_no_module_is_long():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, top
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}


def test_every_package_says_what_lives_there_and_what_it_may_import():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init.relative_to(PACKAGE.parent)} has no docstring"
        if init.parent.name in ALLOWED:
            assert "May import" in doc, f"{init.relative_to(PACKAGE.parent)} does not say what it may import"
