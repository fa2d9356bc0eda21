"""The package's import layering (issue 46): no module imports, even lazily inside a function, a module that
imports it back. The graph is drawn between the package's top-level modules and subpackages (models, layerwise,
io, files, sites, methods, ...), from every `from . import x`, `from .x import y`, `import mlpsurgery.x` in every
file, at any depth of the file. The package's own __init__.py (the public face, which imports everything) is no
layer: `from . import __version__` is not an edge."""

from __future__ import annotations

import ast
from pathlib import Path

import mlpsurgery

ROOT = Path(mlpsurgery.__file__).resolve().parent
# Kept apart by checkpoints.py: what both models and layerwise (and io's export) need of a checkpoint folder.
CHECKPOINT_LAYERS = {"models", "layerwise", "io", "checkpoints"}
# Cycles known and left for now (none): a new cycle fails the test.
KNOWN_CYCLES: list[set[str]] = []


def _unit(parts: list[str]) -> str | None:
    """The top-level module or subpackage of a dotted path inside the package (None: the package itself, or a
    name its __init__ defines, such as __version__)."""
    if not parts:
        return None
    head = parts[0]
    folder = ROOT / head  # a subpackage, or a folder of modules without __init__.py (measure/)
    return head if (ROOT / f"{head}.py").is_file() or folder.is_dir() and any(folder.glob("*.py")) else None


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{module: {module it imports: ["file:line", ...]}} between top-level units (self-imports left out)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        package = parts[:-1]  # the package the file's relative imports start from
        if parts[-1] == "__init__":
            parts = parts[:-1]
        source = _unit(parts)
        if source is None:  # mlpsurgery/__init__.py, __main__.py
            continue
        graph.setdefault(source, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[list[str]] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - (node.level - 1)]
                elif node.module and node.module.split(".")[0] == "mlpsurgery":
                    base = []
                else:
                    continue
                module = [p for p in (node.module or "").split(".") if p]
                if node.level == 0:
                    module = module[1:]
                full = base + module
                # `from . import x` / `from mlpsurgery import x`: x is the module imported
                targets = [full + [a.name] for a in node.names] if not full else [full]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "mlpsurgery"]
            for target in targets:
                unit = _unit(target)
                if unit is not None and unit != source:
                    graph[source].setdefault(unit, []).append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return graph


def cycles(graph) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph, comp: set[str]) -> str:
    """One cycle through the component, each edge with where the import is."""
    start = min(comp)
    path, seen = [start], {start}
    while True:  # every member of a component reaches another member; walk until a module repeats
        nxt = min(w for w in graph[path[-1]] if w in comp)
        if nxt in seen:
            path = path[path.index(nxt):] + [nxt]
            break
        path.append(nxt)
        seen.add(nxt)
    return "\n".join(f"  {a} -> {b}  ({', '.join(graph[a][b])})" for a, b in zip(path, path[1:]))


def test_graph_sees_lazy_imports():
    """The graph holds imports inside functions (layerwise reads the manifest lazily through io)."""
    graph = import_graph()
    assert "io" in graph["layerwise"] and "layerwise" in graph["models"] and "checkpoints" in graph["io"]


def test_no_cycle_through_models_layerwise_io():
    graph = import_graph()
    bad = [c for c in cycles(graph) if c & CHECKPOINT_LAYERS]
    assert not bad, "import cycles through models / layerwise / io / checkpoints:\n" + "\n".join(
        f"{sorted(c)}:\n{describe(graph, c)}" for c in bad)


def test_checkpoints_below_models_layerwise_io():
    """checkpoints.py imports none of the modules it serves, even lazily."""
    assert not set(import_graph()["checkpoints"]) & {"models", "layerwise", "io"}


def test_no_new_cycles():
    graph = import_graph()
    new = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(f"{sorted(c)}:\n{describe(graph, c)}" for c in new)


# The house from the bottom up (README, "Architecture"): a module imports only modules of a lower layer, even lazily.
# Within the shared tools the order is the one their imports need (io before layerwise before models ...).
LAYERS = [
    {"errors", "kernels"},  # the base: errors, files, reports, resources
    {"files", "tensorfiles", "data"},
    {"report", "checksums", "tiny"},
    {"resources"},
    {"sites"},
    {"modules", "checkpoints"},
    {"standalone", "adapters"},
    {"io"},
    {"layerwise"},
    {"models", "subsets"},
    {"parallel"},
    {"capture", "train"},
    {"measure"},
    {"methods"},
    {"compare", "demo"},
    {"cli"},
    {"__main__"},
]


def test_every_module_has_a_layer():
    placed = set().union(*LAYERS)
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and any(p.glob("*.py")))}
    assert units <= placed, f"modules with no layer in LAYERS: {sorted(units - placed)}"


def test_no_module_imports_a_layer_above_it():
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    graph = import_graph()
    up = [f"{a} (layer {rank[a]}) -> {b} (layer {rank[b]}): {', '.join(where[:3])}"
          for a, targets in graph.items() for b, where in targets.items() if rank[b] >= rank[a]]
    assert not up, "imports of a module in the same or a higher layer:\n" + "\n".join(up)
