"""The package's modules import one another in one direction: the graph of their imports (at
the top of a file or inside a function) has no cycle."""

import ast
import pathlib

import flash_msa

PACKAGE = pathlib.Path(flash_msa.__file__).parent


def imports_of(path):
    """The package modules that ``path`` imports (relative imports, anywhere in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:  # from . import a, b
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("."):
                found.add(arg.value[1:])
    return found


def find_cycle(graph):
    """A list of modules forming a cycle, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = {p.stem: imports_of(p) - {p.stem} for p in PACKAGE.glob("*.py")
             if p.stem != "__init__"}
    assert len(graph) >= 6, sorted(graph)  # analysis, distributed, hf, interface, modules, ops
    assert "distributed" in graph["modules"]  # the edge the layer needs, kept one-way
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
