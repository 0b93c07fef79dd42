"""paratrain's modules import one another without a cycle, lazy imports included.

A cycle hidden inside a function still ties two modules into one: neither can
be read, tested or moved without the other, and the order in which they
happen to be first imported decides whether the program starts. So the graph
here is built from every import statement in a module's source, at any depth
(ARCHITECTURE.md: "no import cycles, lazy ones included").

How an import becomes edges, as Python runs it:

- ``import a.b.c`` and ``from a.b.c import name``: the module a.b.c, or
  a.b.c.name where that is a submodule (``from pkg import sub``);
- importing a.b.c first imports the packages a and a.b (their __init__), so
  those are edges too, except the packages the importing module itself sits
  in: they are already being imported when it runs, and counting them would
  make every package whose __init__ imports a submodule a cycle;
- relative imports are resolved against the importing module's package.
"""
import ast
import functools
import pkgutil
import subprocess
import sys
from pathlib import Path

import paratrain

ROOT = Path(paratrain.__file__).resolve().parent


def _unreadable(name):
    raise ImportError(f"pkgutil.walk_packages could not import the package {name}")


def all_modules():
    """{module name: its source file} for paratrain and everything under it (walk_packages
    imports each package to find its submodules; a package that fails is an error)."""
    found = {"paratrain": ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix="paratrain.", onerror=_unreadable):
        spec = info.module_finder.find_spec(info.name)
        found[info.name] = Path(spec.origin)
    return found


def _package_of(name, path):
    """The package a module's relative imports start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(module, level, package):
    """The absolute name of ``from <level dots><module> import ...`` inside ``package``."""
    if level == 0:
        return module
    base = package.split(".")
    if level - 1 >= len(base):
        raise ImportError(f"relative import beyond the top of {package}")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported(name, path, modules):
    """The paratrain modules that ``name`` imports, anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package_of(name, path)
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node.module, node.level, package)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in modules else source)
    edges = set()
    own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    for target in targets:
        if not (target == "paratrain" or target.startswith("paratrain.")):
            continue
        parts = target.split(".")
        for i in range(1, len(parts) + 1):   # the packages above it are imported first
            step = ".".join(parts[:i])
            if step in modules and (step == target or step not in own_packages) and step != name:
                edges.add(step)
        if target == name:
            edges.add(name)   # a module importing itself: a self-loop
    return edges


@functools.lru_cache(maxsize=1)
def import_graph():
    modules = all_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def cycles(graph):
    """Every strongly connected component of more than one module, and every self-loop
    (Tarjan's algorithm, without recursion, so no depth limit applies)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def _a_loop(component, graph):
    """The shortest path from the component's first module back to itself, for the message."""
    members, start = set(component), component[0]
    paths = {n: [start, n] for n in sorted(graph[start]) if n in members}
    while start not in paths:
        paths = {n: path + [n] for path in paths.values() for n in sorted(graph[path[-1]]) if n in members
                 and n not in path[1:]} or {start: [start, "..."]}
    return " -> ".join(paths[start])


def test_the_graph_sees_lazy_relative_and_package_imports():
    """The rules above, on modules whose imports are known."""
    graph = import_graph()
    # a lazy import inside a function counts (job.main imports the launcher when it runs)
    assert "paratrain.launch.local" in graph["paratrain.train.job"]
    # "from .. import config" in a subpackage is the module config, not the package's __init__
    assert "paratrain.config" in graph["paratrain.launch.heap"]
    assert "paratrain" not in graph["paratrain.launch.heap"]
    # importing a submodule of another package imports that package's __init__ too
    assert {"paratrain.comm", "paratrain.comm.rendezvous"} <= graph["paratrain.train.coordination"]
    # "from . import a" in a package's __init__: the package depends on a
    assert "paratrain.train.strategies.allreduce" in graph["paratrain.train.strategies"]


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d"]]
    assert _a_loop(["a", "b", "c"], graph) == "a -> b -> c -> a"


def test_paratrain_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100   # (the walk found the package)
    found = cycles(graph)
    assert not found, "import cycles in paratrain:\n" + "\n".join(_a_loop(c, graph) for c in found)


LEAVES = ("paratrain.train.options", "paratrain.train.layout", "paratrain.train.strategies.pipeline",
          "paratrain.train.strategies.zero", "paratrain.train.trainer", "paratrain.bench.rounds",
          "paratrain.bench.dp_worker", "paratrain.bench.collectives_worker", "paratrain.launch.heap",
          "paratrain.ps.server")

FIRST_EACH = """
import importlib, sys
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "paratrain" or m.startswith("paratrain.")]:
        del sys.modules[loaded]   # each one first: paratrain imported afresh (torch stays loaded)
    importlib.import_module(name)
"""


def test_modules_import_first_in_a_fresh_interpreter():
    """Each of these imported before any other paratrain module: one that only imports
    when another was imported before it (the symptom of a hidden cycle) fails here."""
    res = subprocess.run([sys.executable, "-c", FIRST_EACH, *LEAVES], capture_output=True, text=True, timeout=120,
                         cwd=ROOT.parent)
    assert res.returncode == 0, res.stderr[-3000:]
