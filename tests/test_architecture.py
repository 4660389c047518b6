"""The import rules: the pure layers (envs, rewards, rollout, data, algos, gateway) never import the
trainer, the pipeline or the params (config); the trainer never imports the pipeline; nothing
imports the entry points (stages/, flows/); and turnrl's modules have no import cycle. Every
import counts, the ones inside functions too: a lazy import is still a dependency."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PURE = ("envs", "rewards", "rollout", "data", "algos", "gateway")


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
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


def _turnrl_deps(name: str) -> set[str]:
    """The turnrl modules `name` imports (a `from package import name` of a submodule counts
    as that submodule)."""
    deps = set()
    for target in _imports(name, MODULES[name]):
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            deps.add(target)
    return deps


GRAPH = {name: _turnrl_deps(name) for name in MODULES}


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


def test_no_import_cycle():
    """Tarjan's strongly connected components of the module graph: none larger than one module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
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
                cycles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert cycles == []


def test_the_checker_sees_lazy_and_relative_imports():
    """The rules above could pass by not seeing imports: the trainer's own modules show both kinds."""
    assert "turnrl.training.workers" in GRAPH["turnrl.training.cluster"]   # imported inside a function
    assert "turnrl.envs" in GRAPH["turnrl.config.sections"]                # `from turnrl import envs` in a method
    assert "turnrl.algos.losses" in GRAPH["turnrl.algos.advantages"]       # `from .losses import ...`
