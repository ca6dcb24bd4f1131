"""The package's imports, read from the source (``ast``): module-level imports and the deferred ones inside functions
alike (``if TYPE_CHECKING:`` blocks never run and are left out). No module reaches itself again (no import cycle),
the library rooms never import the CLI layer, and the bottom rooms import nothing of the package."""

import ast
import os

import pytest

import megatron_glm5

PKG = "megatron_glm5"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megatron_glm5.__file__)))


def _modules():
    """{dotted module name: file path} of every module of the package (packages by their ``__init__``)."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PKG)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _is_type_checking(node) -> bool:
    t = node.test
    return isinstance(node, ast.If) and (
        (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING")
        or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"))


def _import_nodes(tree):
    """Every Import / ImportFrom node, at any depth, outside ``if TYPE_CHECKING:`` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def import_graph():
    """{module: set of package modules it imports} (``from pkg import name`` names the submodule when ``name`` is
    one, else ``pkg`` itself)."""
    mods = _modules()

    def resolve(name):
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        is_pkg = path.endswith("__init__.py")
        edges = set()
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names]
            for t in targets:
                if t == PKG or t.startswith(PKG + "."):
                    r = resolve(t)
                    if r is not None and r != mod:
                        edges.add(r)
        graph[mod] = edges
    return graph


def find_cycle(graph):
    """One import cycle as a list ``[a, b, ..., a]``, or None."""
    state = {}
    stack = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "megatron_glm5.config.schema" in graph and "megatron_glm5.models.kda" in graph  # the walk saw the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walk_finds_a_deferred_cycle():
    """The checker itself: a cycle closed by an import inside a function is found."""
    graph = {"a": {"b"}, "b": set()}
    assert find_cycle(graph) is None
    graph["b"].add("a")
    assert find_cycle(graph) == ["a", "b", "a"]
    deferred = ast.parse("def f():\n    from megatron_glm5.errors import one_line\n")
    assert [n.module for n in _import_nodes(deferred)] == ["megatron_glm5.errors"]
    hidden = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import megatron_glm5.config\n")
    assert [getattr(n, "module", None) for n in _import_nodes(hidden)] == ["typing"]


def _rooms_importing(graph, target_prefix):
    return sorted((m, t) for m, ts in graph.items() for t in ts if t == target_prefix or t.startswith(target_prefix + "."))


def test_library_rooms_do_not_import_the_cli_layer():
    graph = import_graph()
    bad = [(m, t) for m, t in _rooms_importing(graph, "megatron_glm5.cli") if not m.startswith("megatron_glm5.cli")]
    assert bad == []


def test_bottom_rooms_import_nothing_of_the_package():
    graph = import_graph()
    for mod in ("megatron_glm5.errors", "megatron_glm5.layer_types"):
        assert graph[mod] == set(), mod
    # kernels (each with its reference beside it, document boundaries in kernels/documents.py) import only
    # each other and the errors
    for mod, targets in graph.items():
        if mod.startswith("megatron_glm5.kernels"):
            outside = {t for t in targets if not t.startswith("megatron_glm5.kernels")}
            assert outside <= {"megatron_glm5.errors"}, (mod, outside)


def _in(mod: str, room: str) -> bool:
    return mod == room or mod.startswith(room + ".")


@pytest.mark.parametrize("room, above", [
    ("megatron_glm5.config", ("megatron_glm5.models", "megatron_glm5.training", "megatron_glm5.kernels",
                              "megatron_glm5.checkpoint", "megatron_glm5.data", "megatron_glm5.execution_plan")),
    ("megatron_glm5.kernels", ("megatron_glm5.models", "megatron_glm5.training", "megatron_glm5.config",
                               "megatron_glm5.execution_plan")),
    ("megatron_glm5.models", ("megatron_glm5.training",)),
])
def test_no_arrow_up(room, above):
    """The layers: config below the models (it imports nothing of models, kernels, training, ...); the kernels below
    the models and the config; the models below the training code. Deferred imports count too."""
    graph = import_graph()
    assert any(_in(m, room) for m in graph), room                     # the room exists
    bad = sorted((m, t) for m, ts in graph.items() if _in(m, room) for t in ts if any(_in(t, a) for a in above))
    assert bad == [], bad


def test_no_private_name_crosses_a_module():
    """No module imports another module's private name (``from megatron_glm5.x import _y``): what modules share is
    public in its one home (e.g. the Triton helpers of the gathering kernels in ``kernels/triton_support.py``, the
    kernels' PyTorch references beside their kernels)."""
    mods = _modules()
    bad = []
    for mod, path in mods.items():
        if not _in(mod, PKG):
            continue
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in _import_nodes(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PKG):
                bad += [(mod, f"{node.module}.{a.name}") for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == [], bad
