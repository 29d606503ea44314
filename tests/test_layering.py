"""The package's import layering, read from the source with ast (nothing is imported).

Imports point down: cli -> engine, bench, plan, mooncake -> cache -> client -> node, rpc,
transfer, protocol -> errors, config. The master and the node are processes of their own
and never import the client side (client, cache, engine, bench, mooncake, plan); the cache
reaches the store only through the backend it is given (never the client module). Every
import counts, also those inside functions (a lazy import is still a dependency), except
the root package's lazy re-exports (``kvpool.Client``), a facade for users.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "kvpool"

# importer prefix -> module prefixes it must never import
FORBIDDEN = {
    "kvpool.master": ("kvpool.client", "kvpool.cache", "kvpool.engine", "kvpool.bench",
                      "kvpool.mooncake", "kvpool.plan", "kvpool.node"),
    "kvpool.node": ("kvpool.client", "kvpool.cache", "kvpool.engine", "kvpool.bench",
                    "kvpool.mooncake", "kvpool.plan", "kvpool.master"),
    "kvpool.cache": ("kvpool.client", "kvpool.engine", "kvpool.bench", "kvpool.mooncake"),
    "kvpool.client": ("kvpool.cache", "kvpool.engine", "kvpool.bench", "kvpool.mooncake",
                      "kvpool.master", "kvpool.launch"),
    "kvpool.transfer": ("kvpool.node", "kvpool.master", "kvpool.client", "kvpool.cache",
                        "kvpool.rpc", "kvpool.http"),
    "kvpool.rpc": ("kvpool.transfer", "kvpool.node", "kvpool.master", "kvpool.client"),
    "kvpool.protocol": ("kvpool.transfer", "kvpool.node", "kvpool.master", "kvpool.client", "kvpool.rpc"),
    "kvpool.errors": ("kvpool.",),
    "kvpool.config": ("kvpool.protocol", "kvpool.transfer", "kvpool.node", "kvpool.master", "kvpool.client"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / ROOT).rglob("*.py"))}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """kvpool modules that ``name`` imports anywhere in its source ("from a import b"
    names the module a.b when that is a module, else a)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
    return {m for m in found if (m == ROOT or m.startswith(ROOT + ".")) and m != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvpool modules it imports (root package excluded, see above)."""
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items() if name != ROOT}


def _within(name: str, prefix: str) -> bool:
    return name == prefix.rstrip(".") or name.startswith(prefix.rstrip(".") + ".")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path per strongly connected group of modules that import each other (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_graph_sees_known_edges():
    graph = import_graph()
    assert "kvpool.rpc" in graph["kvpool.client.client"]
    assert "kvpool.node.segment_host" in graph["kvpool.client.client"]
    assert "kvpool.master.admin" in graph["kvpool.master.cli"]  # a lazy import counts


def test_no_import_circle():
    assert _cycles(import_graph()) == []


def test_a_circle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_down():
    bad = [f"{importer} imports {target}"
           for importer, targets in import_graph().items()
           for prefix, banned in FORBIDDEN.items() if _within(importer, prefix)
           for target in sorted(targets) if any(_within(target, b) for b in banned)]
    assert bad == []


def test_the_child_process_toolkit_stays_at_the_bottom():
    # launch, engine.procs and bench.worker all build on it; the demo's parent stays light
    assert import_graph()["kvpool.child"] <= {"kvpool.errors", "kvpool.config"}
    assert "kvpool.child" in import_graph()["kvpool.engine.procs"]
