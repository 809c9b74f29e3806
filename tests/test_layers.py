"""autopar's imports go one way: import-linter's contracts in pyproject.toml are kept, and no import cycle links
two modules, or two packages (any package's children), of autopar. Cost: about 1 s (the graph takes ~30 ms)."""

from __future__ import annotations

import grimp
import networkx as nx
import pytest
import tomllib
from importlinter.application import use_cases

from tests.lint_imports import PYPROJECT, MappedGraphBuilder, build_graph

ROOT = "autopar"


def _ignored(contract_id: str) -> set[tuple[str, str]]:
    """The imports a contract of pyproject.toml ignores for now (the other engineers' until they land)."""
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = (c for c in contracts if c["id"] == contract_id)
    return {tuple(s.strip() for s in line.split("->")) for line in contract.get("ignore_imports", [])}


def _edges(graph: grimp.ImportGraph) -> set[tuple[str, str]]:
    return {(m, i) for m in graph.modules for i in graph.find_modules_directly_imported_by(m)}


def _child(module: str, package: str) -> str | None:
    """The child of ``package`` that ``module`` is or lies in (None: not under ``package``)."""
    if not module.startswith(package + "."):
        return None
    return ".".join(module.split(".")[: package.count(".") + 2])


def import_cycles(edges: set[tuple[str, str]], root: str = ROOT) -> list[list[str]]:
    """Every import cycle under ``root``, each as the sorted members of one strongly connected component: between
    modules, and for every package between its children (a child stands for everything under it)."""
    graphs = [nx.DiGraph([(a, b) for a, b in edges if a != b])]
    modules = {m for e in edges for m in e if m == root or m.startswith(root + ".")}
    for package in sorted({m.rsplit(".", 1)[0] for m in modules if "." in m}):
        children = [(_child(a, package), _child(b, package)) for a, b in edges]
        graphs.append(nx.DiGraph([(a, b) for a, b in children if a and b and a != b]))
    cycles = {tuple(sorted(c)) for g in graphs for c in nx.strongly_connected_components(g) if len(c) > 1}
    return sorted(list(c) for c in cycles)


def _report(builder: MappedGraphBuilder) -> dict[str, bool]:
    """Contract id -> kept, for pyproject.toml's contracts checked on the graph ``builder`` makes."""
    previous = use_cases.settings.GRAPH_BUILDER
    use_cases.settings.configure(GRAPH_BUILDER=builder)
    try:
        use_cases._register_built_in_contract_types()
        report = use_cases.create_report(use_cases.read_user_options(str(PYPROJECT)), cache_dir=None)
    finally:
        use_cases.settings.configure(GRAPH_BUILDER=previous)
    return {contract.contract_options["id"]: check.kept for contract, check in report.get_contracts_and_checks()}


class _WithImports(MappedGraphBuilder):
    """The real graph plus some imports."""

    def __init__(self, *imports: tuple[str, str]):
        self.imports = imports

    def build(self, *args, **kwargs) -> grimp.ImportGraph:
        graph = super().build(*args, **kwargs)
        for importer, imported in self.imports:
            graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="(test)")
        return graph


@pytest.fixture(scope="module")
def edges() -> set[tuple[str, str]]:
    return _edges(build_graph(ROOT)) - _ignored("acyclic")


def test_the_graph_holds_every_layer(edges):
    """The graph follows package-dir: autopar.ir, .schedule, .solver, .passes and .runtime are in it, with their
    imports."""
    modules = {m for e in edges for m in e}
    for layer in ("ir", "schedule", "solver", "passes", "runtime", "cli"):
        assert any(m.startswith(f"{ROOT}.{layer}.") for m in modules), layer
    assert ("autopar.passes.shard", "autopar.solver.sharding.solve") in edges


def test_no_import_cycle_between_modules_or_packages(edges):
    assert import_cycles(edges) == []


def test_a_cycle_between_modules_or_packages_is_found(edges):
    """Broken inputs: a module cycle, a cycle between two packages whose modules form none, and the real graph
    with one import of a higher layer from the IR core."""
    assert import_cycles({("a.x", "a.y"), ("a.y", "a.x"), ("a.y", "a.z")}, "a") == [["a.x", "a.y"]]
    packages = {("a.p.m", "a.q.n"), ("a.q.k", "a.p.j"), ("a.r", "a.p.m")}
    assert import_cycles(packages, "a") == [["a.p", "a.q"]]
    assert import_cycles(packages - {("a.q.k", "a.p.j")}, "a") == []
    found = import_cycles(edges | {("autopar.ir.core", "autopar.runtime.build.codegen")})
    assert any({"autopar.ir", "autopar.runtime"} <= set(c) for c in found)  # the packages
    assert any({"autopar.ir.core", "autopar.runtime.build.codegen"} <= set(c) for c in found)  # the modules


CONTRACTS = ("layers", "runtime-layers", "solver-layers", "acyclic")


def test_the_import_linter_contracts_are_kept():
    assert _report(MappedGraphBuilder()) == dict.fromkeys(CONTRACTS, True)


def test_the_contracts_break_on_an_upward_import_or_a_cycle(edges):
    """Broken inputs: the solver importing the runtime breaks the layers (and, as the runtime imports the solver,
    makes a cycle); two facade modules importing each other make a cycle, which the layers allow."""
    upward = ("autopar.solver.sharding.cost", "autopar.runtime.build.codegen")
    assert upward not in edges
    broken = {"layers": False, "runtime-layers": False, "acyclic": False}  # the runtime's comm reaches its build
    assert _report(_WithImports(upward)) == dict.fromkeys(CONTRACTS, True) | broken
    facade = {("autopar.models.resolve", "autopar.check.rules"), ("autopar.check.rules", "autopar.models.resolve")}
    assert not facade & edges
    assert _report(_WithImports(*facade)) == dict.fromkeys(CONTRACTS, True) | {"acyclic": False}


def test_the_folder_contracts_break_on_an_upward_import(edges):
    """Broken inputs: the schedule layer importing the solver (its in-flight counts must not come from above),
    the runtime's communication importing its executor, the cluster specs importing the stage balance."""
    schedule = ("autopar.schedule.generators", "autopar.solver.stages.balance")
    runtime = ("autopar.runtime.comm.collectives", "autopar.runtime.execute.executor")
    solver = ("autopar.solver.cluster.spec", "autopar.solver.stages.balance")
    assert not {schedule, runtime, solver} & edges
    assert not _report(_WithImports(schedule))["layers"]
    assert _report(_WithImports(runtime)) == dict.fromkeys(CONTRACTS, True) | {
        "runtime-layers": False,
        "acyclic": False,
    }
    assert _report(_WithImports(solver)) == dict.fromkeys(CONTRACTS, True) | {"solver-layers": False, "acyclic": False}
