"""The import rules: the pure layers (envs, rewards, rollout, data, algos, gateway) never import the
trainer, the pipeline or the params (config); the trainer never imports the pipeline; nothing
imports the entry points (stages/, flows/); turnrl's modules have no import cycle, and neither
have its packages (turnrl.data -> turnrl.rewards -> turnrl.data is a cycle even when no single
module closes it: the packages are the floors of the house, and every arrow points down). Every
import counts, the ones inside functions too: a lazy import is still a dependency."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PURE = ("envs", "rewards", "rollout", "data", "algos", "gateway")


def _modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in src.rglob("*.py"):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The names every import statement of the module reaches (absolute, relative resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _turnrl_deps(name: str, modules: dict[str, Path] = MODULES) -> set[str]:
    """The turnrl modules `name` imports (a `from package import name` of a submodule counts
    as that submodule)."""
    deps = set()
    for target in _imports(name, modules[name]):
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            deps.add(target)
    return deps


def module_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the modules it imports, for every module of the tree under `src`."""
    modules = _modules(src)
    return {name: _turnrl_deps(name, modules) for name in modules}


GRAPH = module_graph()


def _arrows(source: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules under `source` that import a module under one of `forbidden`, and what."""
    def under(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")
    offenders = {name: sorted(d for d in deps if any(under(d, f) for f in forbidden))
                 for name, deps in GRAPH.items() if under(name, source)}
    return {k: v for k, v in offenders.items() if v}


@pytest.mark.parametrize("layer", PURE)
def test_the_pure_layers_never_import_the_trainer_the_pipeline_or_the_params(layer):
    assert _arrows(f"turnrl.{layer}", ("turnrl.training", "turnrl.pipeline", "turnrl.config")) == {}


def test_the_trainer_never_imports_the_pipeline():
    assert _arrows("turnrl.training", ("turnrl.pipeline",)) == {}


def test_the_rule_checker_finds_an_arrow_back_up():
    """The rules above could pass by not looking: a module of the trainer that imports the
    pipeline, added to the graph, is found."""
    GRAPH["turnrl.training._probe"] = {"turnrl.pipeline.evaluate"}
    try:
        assert _arrows("turnrl.training", ("turnrl.pipeline",)) == {"turnrl.training._probe": ["turnrl.pipeline.evaluate"]}
    finally:
        del GRAPH["turnrl.training._probe"]


def test_nothing_in_the_package_imports_the_entry_points():
    for name, path in MODULES.items():
        reached = {t.split(".")[0] for t in _imports(name, path)}
        assert not reached & {"stages", "flows"}, name


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph` larger than one node: its cycles."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def package_of(module: str) -> str:
    """The floor a module lives on: turnrl.<package> (or turnrl.<module> for a top-level one)."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """turnrl.<package> -> the turnrl.<package>s its modules import (itself left out)."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        source = package_of(module)
        out.setdefault(source, set()).update(package_of(d) for d in deps if package_of(d) != source)
    return out


def package_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per package-level cycle: its shortest circle through its first package, and the
    module imports behind each arrow of it (so a failure says which import to move)."""
    packages = package_graph(graph)
    lines = []
    for component in cycles(packages):
        members, start = set(component), component[0]
        before: dict[str, str] = {}
        frontier, last = [start], None
        while last is None:   # breadth first: the shortest way back to `start`
            reached = []
            for v in frontier:
                for w in sorted(packages[v] & members):
                    if w == start:
                        last = v
                        break
                    if w not in before:
                        before[w] = v
                        reached.append(w)
                if last is not None:
                    break
            frontier = reached
        circle = [last]
        while circle[-1] != start:
            circle.append(before[circle[-1]])
        circle = circle[::-1] + [start]
        arrows = []
        for a, b in zip(circle, circle[1:]):
            for module, deps in sorted(graph.items()):
                into = {d for d in deps if package_of(module) == a and package_of(d) == b}
                # a package and its module both imported: name the module
                arrows += [f"{module} -> {d}" for d in sorted(into) if not any(e.startswith(d + ".") for e in into)]
        lines.append(f"{' -> '.join(circle)}: {'; '.join(arrows)}")
    return lines


def test_no_import_cycle():
    """No module imports itself round a circle."""
    assert cycles(GRAPH) == []


def test_no_package_import_cycle():
    """No package reaches itself through other packages: every package-level arrow points down."""
    assert package_cycles(GRAPH) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "turnrl" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_package_cycle_checker_reports_a_cycle_made_on_purpose(tmp_path):
    """A synthetic tree: turnrl.low's module imports nothing upward, then gets an import of the
    high package inside a function (lazy), which makes low <-> high, though no module cycle."""
    files = {"__init__.py": "", "low/__init__.py": "", "low/util.py": "def f():\n    return 1\n",
             "low/more.py": "from .util import f\n",
             "high/__init__.py": "", "high/user.py": "from turnrl.low.util import f\n"}
    clean = module_graph(_tree(tmp_path / "clean", files))
    assert clean["turnrl.low.more"] == {"turnrl.low.util"} and package_cycles(clean) == []
    lazy = {**files, "low/more.py": "def g():\n    from turnrl.high import user\n    return user\n"}
    graph = module_graph(_tree(tmp_path / "lazy", lazy))
    assert cycles(graph) == []   # no module reaches itself: only the package-level check sees it
    assert package_cycles(graph) == [
        "turnrl.high -> turnrl.low -> turnrl.high: turnrl.high.user -> turnrl.low.util; "
        "turnrl.low.more -> turnrl.high.user"]


def test_the_package_cycle_checker_sees_relative_imports_and_longer_circles(tmp_path):
    """Three packages in a circle, one arrow a relative import (`from ..c import z`) at module level."""
    files = {"__init__.py": "", "a/__init__.py": "", "a/x.py": "import turnrl.b.y\n",
             "b/__init__.py": "", "b/y.py": "from ..c import z\n",
             "c/__init__.py": "", "c/z.py": "class Z:\n    def m(self):\n        from turnrl.a import x\n"}
    graph = module_graph(_tree(tmp_path, files))
    assert graph["turnrl.b.y"] == {"turnrl.c", "turnrl.c.z"}   # the package, then its module
    assert package_graph(graph)["turnrl.c"] == {"turnrl.a"}
    assert package_cycles(graph) == ["turnrl.a -> turnrl.b -> turnrl.c -> turnrl.a: turnrl.a.x -> turnrl.b.y; "
                                     "turnrl.b.y -> turnrl.c.z; turnrl.c.z -> turnrl.a.x"]


def test_the_checker_sees_lazy_and_relative_imports():
    """The rules above could pass by not seeing imports: the trainer's own modules show both kinds."""
    assert "turnrl.training.workers" in GRAPH["turnrl.training.cluster"]   # imported inside a function
    assert "turnrl.envs" in GRAPH["turnrl.config.sections"]                # `from turnrl import envs` in a method
    assert "turnrl.algos.losses" in GRAPH["turnrl.algos.advantages"]       # `from .losses import ...`
