"""`lint-imports` for autopar's layout: grimp's import graph of every directory pyproject.toml maps into autopar.

grimp finds a package's modules by walking its one directory, but autopar.ir, autopar.passes, autopar.solver and
autopar.runtime live in ir/, passes/, solver/ and runtime/ (setuptools' package-dir), so a bare `lint-imports` sees
only autopar/. Here each root package is built together with the subpackages `[tool.setuptools.package-dir]` maps
elsewhere. `python -m tests.lint_imports [lint-imports options]` is import-linter's own command with that graph;
`build_graph()` is the same graph for the tests.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import grimp
import importlinter.api  # noqa: F401 - its import resets import-linter's settings: before use_mapped_graph()
import importlinter.cli
import tomllib
from grimp.adaptors.packagefinder import ImportLibPackageFinder
from grimp.application.config import settings as grimp_settings
from importlinter.application.app_config import settings as importlinter_settings
from importlinter.application.ports.building import GraphBuilder

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def mapped_subpackages(root: str, pyproject: Path = PYPROJECT) -> list[str]:
    """The subpackages of ``root`` that pyproject.toml's package-dir maps to a directory of their own."""
    package_dir = tomllib.loads(pyproject.read_text())["tool"]["setuptools"].get("package-dir", {})
    return sorted(name for name in package_dir if name.startswith(root + "."))


class _MappedPackageFinder(ImportLibPackageFinder):
    """grimp's package finder, also answering for a subpackage (grimp refuses one, expecting its parent's walk to
    find it); only the subpackages package-dir maps elsewhere are asked for, so no module is found twice."""

    def determine_package_directories(self, package_name, file_system):
        if "." not in package_name:
            return super().determine_package_directories(package_name, file_system)
        spec = importlib.util.find_spec(package_name)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"Could not find package '{package_name}' (mapped in {PYPROJECT.name}).")
        return set(spec.submodule_search_locations)


def build_graph(*roots: str, cache_dir: str | None = None, **options) -> grimp.ImportGraph:
    """grimp's import graph of ``roots`` (default autopar) and every subpackage package-dir maps elsewhere."""
    names = [name for root in roots or ("autopar",) for name in (root, *mapped_subpackages(root))]
    previous = grimp_settings.PACKAGE_FINDER
    grimp_settings.configure(PACKAGE_FINDER=_MappedPackageFinder())
    try:
        return grimp.build_graph(*names, cache_dir=cache_dir, **options)
    finally:
        grimp_settings.configure(PACKAGE_FINDER=previous)


class MappedGraphBuilder(GraphBuilder):
    """import-linter's graph builder, through :func:`build_graph`."""

    def build(
        self, root_package_names, cache_dir, include_external_packages=False, exclude_type_checking_imports=False
    ):
        return build_graph(
            *root_package_names,
            cache_dir=cache_dir,
            include_external_packages=include_external_packages,
            exclude_type_checking_imports=exclude_type_checking_imports,
        )


def use_mapped_graph() -> None:
    """Make import-linter (its command and its Python API) build graphs with :class:`MappedGraphBuilder`."""
    importlinter_settings.configure(GRAPH_BUILDER=MappedGraphBuilder())


if __name__ == "__main__":
    use_mapped_graph()
    sys.exit(importlinter.cli.lint_imports_command())
