"""The package layout shows the design (DESIGN.md "Package layout"): imports point one way, with no circles.

Every import counts, wherever it stands: at the top of a module, inside a function, or under TYPE_CHECKING.
A circle hidden inside a function is still a circle, and the rules below are about what a part may know.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rolloutpipe"

ALLOWED = {
    "rolloutpipe": set(),
    "types": set(),
    "model": set(),
    "control": {"types", "model"},
    "observe": {"types", "control"},
    "rollout": {"types", "model", "control", "observe"},
    "trainer": {"types", "model", "control", "observe"},
    "config": {"types", "model", "control", "observe", "rollout", "trainer", "launch.config"},
    "node": {"types", "model", "control", "observe", "rollout", "trainer", "config"},
    "pipeline": {"types", "model", "config", "control", "observe", "rollout", "trainer", "node"},
    "launch.config": {"types", "model", "control"},
    "launch": {"types", "model", "config", "control", "observe", "rollout", "trainer", "pipeline", "node",
               "launch.config"},
    "sim": {"rolloutpipe", "types", "model", "config", "control", "observe", "rollout", "trainer"},
}
"""What each layer of the package may import besides itself, the drawing of DESIGN.md: types and model at the
bottom, control (the plane between the node groups) above them, observe above control, the two node groups side
by side, never importing each other, then config.py, which binds the section configs that live beside each
component (rollout/config.py, trainer/config.py, launch/config.py, ...), then the node modules, the top of each
wing and the only modules that read the root Config, then pipeline, launch and the simulator."""

NODE_MODULES = {"rolloutpipe.rollout.node", "rolloutpipe.trainer.node"}
"""The top of each node group's wing: the one module of each that reads the root Config (DESIGN.md)."""


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


def layer(module: str) -> str:
    """Where ``module`` sits in the drawing: its area, but the node modules form a layer of their own above
    config, and launch/config.py (the launcher's section) is one of the section configs below it."""
    if module in NODE_MODULES:
        return "node"
    return "launch.config" if module == "rolloutpipe.launch.config" else area(module)


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
    """Imports across layers that point up or sideways; a node module may import only its own wing."""
    def wrong(m: str, dep: str) -> bool:
        if layer(m) == "node" and layer(dep) in ("rollout", "trainer"):
            return area(dep) != area(m)
        return layer(dep) != layer(m) and layer(dep) not in ALLOWED[layer(m)]

    return [f"{m} imports {dep}" for m, deps in sorted(graph.items()) for dep in sorted(deps) if wrong(m, dep)]


def test_no_module_import_circle():
    assert find_circle(import_graph()) is None


def test_rollout_and_trainer_never_import_each_other_and_every_part_imports_only_below_it():
    graph = import_graph()
    assert set(map(layer, graph)) <= set(ALLOWED), "a new part of the package: give it a row in ALLOWED"
    assert layering_violations(graph) == []


def test_the_guards_see_a_circle_a_hidden_import_and_a_cross_import():
    graph = import_graph()
    planted = {**graph, "rolloutpipe.config": graph["rolloutpipe.config"] | {"rolloutpipe.pipeline"}}
    assert find_circle(planted) is not None
    planted = ("def late():\n    from rolloutpipe.trainer import grpo\n"
               "    from ..trainer.batching import BatchConsumer\n")
    hidden = imports_of("rolloutpipe.rollout.planted", planted, set(graph))
    assert hidden == {"rolloutpipe.trainer.grpo", "rolloutpipe.trainer.batching"}
    assert layering_violations({**graph, "rolloutpipe.rollout.planted": hidden}) == [
        "rolloutpipe.rollout.planted imports rolloutpipe.trainer.batching",
        "rolloutpipe.rollout.planted imports rolloutpipe.trainer.grpo"]
    from_below = {"rolloutpipe.rollout.dispatcher": graph["rolloutpipe.rollout.dispatcher"] | {"rolloutpipe.config"},
                  "rolloutpipe.trainer.node": graph["rolloutpipe.trainer.node"] | {"rolloutpipe.rollout.data"}}
    assert layering_violations({**graph, **from_below}) == ["rolloutpipe.rollout.dispatcher imports rolloutpipe.config",
                                                            "rolloutpipe.trainer.node imports rolloutpipe.rollout.data"]


def test_the_top_level_holds_few_modules_and_no_module_is_long():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, top
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}


def may_import(doc: str) -> dict[str, set[str]]:
    """A package docstring's "May import:" line, read: ``{"": what every module may import, "<module>": what that
    one may also import}``. The line lists parts of the package up to its first full stop: ``types``, ``config``
    (a module), ``control/`` (a package, all of it), ``rollout/config.py`` (one module), each with an aside in
    brackets if need be; ``; node.py also config`` gives one module of the package more."""
    text = re.sub(r" \([^)]*\)", "", " ".join(doc.split("May import:", 1)[1].split()))  # asides go
    parts = text.split(". ", 1)[0].removesuffix(".").split(";")
    allowed = {"": {token.strip() for token in parts[0].split(",")}}
    for extra in parts[1:]:
        module, _, tokens = extra.strip().partition(" also ")
        allowed[module.removesuffix(".py")] = {token.strip() for token in tokens.split(",")}
    return allowed


def covered(dep: str, token: str) -> bool:
    target = "rolloutpipe" if token == "rolloutpipe" else "rolloutpipe." + token.removesuffix(".py").replace("/", ".")
    return dep.startswith(target.removesuffix(".") + ".") or dep == target.removesuffix(".")


def own_line_violations(graph: dict[str, set[str]], docs: dict[str, str]) -> list[str]:
    """Imports that leave a package for a part its own "May import:" line does not name (``docs``: package ->
    docstring). Imports inside the package are its own business; the top package's line is the drawing
    (ALLOWED)."""
    found = []
    for package, doc in sorted(docs.items()):
        allowed = may_import(doc)
        for m, deps in sorted(graph.items()):
            if not m.startswith(package + ".") or m.count(".") > package.count(".") + 1 and any(
                    m.startswith(sub + ".") for sub in docs if sub.startswith(package + ".")):
                continue  # not in the package, or in a sub-package (its own line decides)
            tokens = allowed[""] | allowed.get(m.rpartition(".")[2], set())
            found += [f"{m} imports {dep}, which {package}'s May import line does not name"
                      for dep in sorted(deps) if not dep.startswith(package + ".") and dep != package
                      and not any(covered(dep, token) for token in tokens)]
    return found


def package_docs() -> dict[str, str]:
    return {module_name(init): ast.get_docstring(ast.parse(init.read_text())) or ""
            for init in sorted(PACKAGE.rglob("*/__init__.py"))}


def test_every_package_says_what_lives_there_and_what_it_may_import():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init.relative_to(PACKAGE.parent)} has no docstring"
        assert "May import:" in doc, f"{init.relative_to(PACKAGE.parent)} does not say what it may import"


def test_every_package_keeps_to_its_own_may_import_line():
    assert own_line_violations(import_graph(), package_docs()) == []


def test_the_own_line_check_sees_a_package_breaking_its_line():
    graph, docs = import_graph(), package_docs()
    planted = {**graph, "rolloutpipe.rollout.engines.base": graph["rolloutpipe.rollout.engines.base"]
               | {"rolloutpipe.rollout.rewards"}}
    assert own_line_violations(planted, docs) == [
        ("rolloutpipe.rollout.engines.base imports rolloutpipe.rollout.rewards, which rolloutpipe.rollout.engines's "
         "May import line does not name")]
    assert may_import("May import: types, control/; node.py also config. Never trainer/.") == {
        "": {"types", "control/"}, "node": {"config"}}
