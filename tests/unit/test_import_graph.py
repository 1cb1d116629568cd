"""The package's import graph has no circles, library code never imports the CLI, and each room
imports only what the process it runs in runs (docs/architecture.md).

Every import in every ``.py`` under ``megascale/`` counts, function-local (lazy) ones included:
a lazy import that closes a cycle is still a circle. Imports under ``if TYPE_CHECKING:`` never
run and are left out. ``from a.b import c`` depends on ``a.b`` (its ``__init__`` runs) and on
``a.b.c`` when that is a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megascale

PACKAGE = Path(megascale.__file__).parent
ROOT = PACKAGE.parent
CLI_ENTRY_POINTS = {"megascale.cli", "megascale.__main__"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom in ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if _is_type_checking(node):
            children = node.orelse  # the body never runs
        stack.extend(children)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the ``megascale`` modules it imports (the nearest existing module of a name)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _import_nodes(tree):
            for target in _targets(node, module, path.name == "__init__.py"):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when it has none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_find_cycle_reports_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "megascale.agent.service" in graph["megascale.cli"]  # imported inside a function
    assert "megascale.train.command" in graph["megascale.cli"]  # at the top
    assert len(graph) > 100 and all(m.startswith("megascale") for m in graph)
    relative = ast.parse("from ..store import Store\nfrom . import keys").body
    assert _targets(relative[0], "megascale.controller.service", False) == [
        "megascale.store",
        "megascale.store.Store",
    ]
    assert _targets(relative[1], "megascale.etcd", True) == [
        "megascale.etcd",
        "megascale.etcd.keys",
    ]


def test_type_checking_imports_are_left_out():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\n")
    assert sorted(n.names[0].name for n in _import_nodes(tree)) == ["a", "c"]


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_library_code_never_imports_the_cli():
    importers = sorted(
        module
        for module, deps in import_graph().items()
        if "megascale.cli" in deps and module not in CLI_ENTRY_POINTS
    )
    assert not importers, f"library modules that import megascale.cli: {importers}"


# The rooms follow the processes (docs/architecture.md). What a room may not import, because the
# process it runs in does not run that code: a training rank never runs the controller, the agent,
# the etcd client, the operator or the offline tools; the operator talks to etcd only.
RANK_ROOMS = ("model", "data", "train", "parallel", "overlap", "probes")
NOT_IN_A_RANK = {"tools", "controller", "agent", "etcd", "k8s"}
ROOM_MAY_NOT_IMPORT = {
    **{room: NOT_IN_A_RANK for room in RANK_ROOMS},
    "probes": NOT_IN_A_RANK | {"launcher"},
    "k8s": {"controller", "agent", "launcher", "tools", *RANK_ROOMS},
}


def room(module: str) -> str:
    """``megascale.probes.timers`` -> ``probes``; a module at the package root -> ``root``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "root"


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        if room(dep) in ROOM_MAY_NOT_IMPORT.get(room(module), ())
    )


def test_room_contracts_catch_a_forbidden_import():
    graph = {"megascale.probes.timers": {"megascale.controller.service", "megascale.config"}}
    assert room_violations(graph) == ["megascale.probes.timers -> megascale.controller.service"]


def test_rooms_import_only_what_their_process_runs():
    assert room_violations(import_graph()) == []


def test_only_the_cli_imports_the_offline_tools():
    importers = sorted(
        module
        for module, deps in import_graph().items()
        if module not in CLI_ENTRY_POINTS and room(module) != "tools"
        if any(room(dep) == "tools" for dep in deps)
    )
    assert not importers, f"modules outside tools/ that import it: {importers}"
