"""The package's layers: each subpackage imports only the ones below it (the table), type-only
and function-local imports included, and no modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = {
    "xla_strategies": ROOT / "xla_strategies",
    "xla_strategies.passes": ROOT / "passes",
    "xla_strategies.runtime": ROOT / "runtime",
}
_BELOW_STEP = {"core", "cluster_resolver", "passes", "hardware", "runtime"}
_BELOW_FRONTENDS = _BELOW_STEP | {"step", "distribute", "strategies"}
#: Which subpackage of `xla_strategies` may import which, bottom up. "" is the package's own
#: `__init__` (the public names), which may import anything.
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "cluster_resolver": {"core"},
    "passes": {"core"},
    "hardware": {"core", "passes"},
    "runtime": {"core", "cluster_resolver", "hardware"},
    "step": _BELOW_STEP,
    "distribute": _BELOW_STEP | {"step"},
    "strategies": _BELOW_STEP | {"step", "distribute"},
    "keras": _BELOW_FRONTENDS,
    "torch": _BELOW_FRONTENDS,
    "experimental": _BELOW_FRONTENDS,
    "cli": _BELOW_FRONTENDS | {"demo"},
    "demo": _BELOW_FRONTENDS,
    "": _BELOW_FRONTENDS | {"keras", "torch", "experimental", "cli", "demo"},
    "__main__": {"cli"},  # `python -m xla_strategies`
}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def _imports(path: Path, known: set[str]) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:  # `from pkg import submodule` needs pkg/__init__ too,
                sub = f"{node.module}.{alias.name}"  # but that is Python's own business
                names.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n in known}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(path, known) - {name} for name, path in modules.items()}
    # `import xla_strategies.x` also runs `xla_strategies/__init__`: ignore that edge, as
    # Python does for a package importing its own submodules.
    for name in graph:
        graph[name].discard("xla_strategies")
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _subpackage(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def _upward(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for source, targets in sorted(graph.items()):
        here = _subpackage(source)
        for target in sorted(targets):
            there = _subpackage(target)
            if there != here and there not in MAY_IMPORT[here]:
                found.append(f"{source} -> {target}")
    return found


def test_every_subpackage_has_a_place_in_the_table():
    assert {_subpackage(m) for m in _modules()} <= set(MAY_IMPORT)


def test_imports_point_down_the_layers():
    upward = _upward(_graph())
    assert not upward, "imports against the table:\n" + "\n".join(upward)


def test_the_checker_finds_an_upward_import():
    graph = {"xla_strategies.core.context": {"xla_strategies.distribute.strategy"}}
    assert _upward(graph) == ["xla_strategies.core.context -> xla_strategies.distribute.strategy"]


def test_no_import_circle():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_checker_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_every_package_is_in_the_wheel():
    """A package folder missing from pyproject's list would be missing from a wheel,
    while an editable install still finds it."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).parents[1]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {package: Path(path) for package, path in setuptools["package-dir"].items()}
    listed = set(setuptools["packages"])
    for package, folder in folders.items():
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            assert ".".join((package, *parts)) in listed, init


def test_every_strategy_is_what_the_lower_layers_read():
    """The Protocols the layers below the Strategy base type a strategy with name members
    every strategy has (a member renamed in one place would fail here)."""
    import xla_strategies as xs
    from xla_strategies.core.strategy_like import StrategyLike
    from xla_strategies.step.step_strategy import StepStrategy

    strategies = [
        xs.OneDeviceStrategy(),
        xs.MirroredStrategy(),
        xs.experimental.CentralStorageStrategy(),
        xs.TPUStrategy("v5e-8", emulate=True),
        xs.TPUStrategy("v5e-16", compile_only=True),
        xs.get_strategy(),
    ]
    for strategy in strategies:
        assert isinstance(strategy, StrategyLike), type(strategy).__name__
        assert isinstance(strategy, StepStrategy), type(strategy).__name__
    assert not isinstance(object(), StrategyLike)


def test_every_pass_is_exported_by_name():
    import xla_strategies.passes as passes

    for cls in passes.PASSES:
        assert cls.__name__ in passes.__all__ and getattr(passes, cls.__name__) is cls
