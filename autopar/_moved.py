"""The module paths of autopar 0.1 before its folders were sorted by job: each still imports, with a
DeprecationWarning naming its new path, for one release.

A moved module (``autopar.runtime.schedules``) is found by a meta-path finder that returns the module at its
new path (``autopar.schedule.generators``); a module whose old path is now a package
(``autopar.runtime.checkpoint``) forwards the old module's names from the package's ``__getattr__``
(``forward``). Nothing here is imported by autopar itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from typing import Any

# old module -> its module now
MOVED = {
    "autopar.check_report": "autopar.check.report",
    "autopar.check_scale": "autopar.check.scale",
    "autopar.float64": "autopar.check.float64",
    "autopar.model_families": "autopar.models.families",
    "autopar.presets": "autopar.models.presets",
    "autopar.rulecheck": "autopar.check.rules",
    "autopar.runtime.action_costs": "autopar.schedule.action_costs",
    "autopar.runtime.actions": "autopar.schedule.actions",
    "autopar.runtime.batch": "autopar.runtime.call.batch",
    "autopar.runtime.calibrate": "autopar.runtime.measure.calibrate",
    "autopar.runtime.chart": "autopar.schedule.chart",
    "autopar.runtime.checkpoint_files": "autopar.runtime.checkpoint.files",
    "autopar.runtime.clip": "autopar.runtime.grads.clip",
    "autopar.runtime.codegen": "autopar.runtime.build.codegen",
    "autopar.runtime.collectives": "autopar.runtime.comm.collectives",
    "autopar.runtime.column_linear": "autopar.runtime.comm.column_linear",
    "autopar.runtime.executor": "autopar.runtime.execute.executor",
    "autopar.runtime.executor_p2p": "autopar.runtime.execute.p2p",
    "autopar.runtime.executor_state": "autopar.runtime.execute.state",
    "autopar.runtime.export": "autopar.runtime.checkpoint.export",
    "autopar.runtime.formulas": "autopar.schedule.formulas",
    "autopar.runtime.init": "autopar.runtime.build.init_weights",
    "autopar.runtime.inputs": "autopar.runtime.call.inputs",
    "autopar.runtime.jsonstate": "autopar.runtime.checkpoint.jsonstate",
    "autopar.runtime.lazy": "autopar.runtime.comm.lazy",
    "autopar.runtime.listsched": "autopar.schedule.list_scheduling",
    "autopar.runtime.loss_weight": "autopar.runtime.call.loss_weight",
    "autopar.runtime.memory": "autopar.runtime.measure.memory",
    "autopar.runtime.module_views": "autopar.runtime.views",
    "autopar.runtime.one_stage": "autopar.runtime.sim.one_stage",
    "autopar.runtime.optim": "autopar.runtime.grads.optimizer",
    "autopar.runtime.outputs": "autopar.runtime.call.outputs",
    "autopar.runtime.p2p": "autopar.schedule.comm_actions",
    "autopar.runtime.params": "autopar.runtime.build.params",
    "autopar.runtime.pending": "autopar.runtime.comm.pending",
    "autopar.runtime.pieces": "autopar.runtime.checkpoint.pieces",
    "autopar.runtime.placement_values": "autopar.runtime.sim.placement_values",
    "autopar.runtime.precision": "autopar.runtime.build.precision",
    "autopar.runtime.ranksim": "autopar.runtime.sim.ranksim",
    "autopar.runtime.rng": "autopar.runtime.build.rng",
    "autopar.runtime.safetensors_io": "autopar.runtime.checkpoint.safetensors_io",
    "autopar.runtime.schedules": "autopar.schedule.generators",
    "autopar.runtime.shards": "autopar.runtime.comm.shards",
    "autopar.runtime.simgroup": "autopar.runtime.sim.groups",
    "autopar.runtime.simulator": "autopar.schedule.simulator",
    "autopar.runtime.split_backward": "autopar.runtime.execute.split_backward",
    "autopar.runtime.stage_runner": "autopar.runtime.execute.stage_runner",
    "autopar.runtime.stages": "autopar.runtime.build.stages",
    "autopar.runtime.state_pieces": "autopar.runtime.checkpoint.state_pieces",
    "autopar.runtime.subpipeline": "autopar.runtime.execute.subpipeline",
    "autopar.runtime.teardown": "autopar.runtime.comm.teardown",
    "autopar.runtime.timeline": "autopar.schedule.timeline",
    "autopar.runtime.trace": "autopar.runtime.measure.trace",
    "autopar.runtime.vocab_parallel": "autopar.runtime.comm.vocab_parallel",
    "autopar.runtime.zero": "autopar.runtime.grads.zero",
    "autopar.runtime.zero3": "autopar.runtime.grads.zero3",
    "autopar.runtime.zero3_grads": "autopar.runtime.grads.unit_grads",
    "autopar.runtime.zero3_graph": "autopar.runtime.grads.unit_gathers",
    "autopar.runtime.zero_bubble": "autopar.schedule.zero_bubble",
    "autopar.simtrain": "autopar.check.simtrain",
    "autopar.small_families": "autopar.models.small_families",
    "autopar.solver.baselines": "autopar.solver.sharding.baselines",
    "autopar.solver.blocks": "autopar.solver.sharding.blocks",
    "autopar.solver.buckets": "autopar.solver.sharding.buckets",
    "autopar.solver.cluster_fields": "autopar.solver.cluster.fields",
    "autopar.solver.cost": "autopar.solver.sharding.cost",
    "autopar.solver.eliminate": "autopar.solver.sharding.eliminate",
    "autopar.solver.groups": "autopar.solver.sharding.groups",
    "autopar.solver.ilp": "autopar.solver.sharding.ilp",
    "autopar.solver.megatron_roles": "autopar.solver.sharding.megatron_roles",
    "autopar.solver.memory": "autopar.solver.sharding.memory",
    "autopar.solver.one_axis": "autopar.solver.sharding.one_axis",
    "autopar.solver.options": "autopar.solver.sharding.options",
    "autopar.solver.partition": "autopar.solver.stages.partition",
    "autopar.solver.pipeline_shape": "autopar.schedule.placement",
    "autopar.solver.problem": "autopar.solver.sharding.problem",
    "autopar.solver.rules_contractions": "autopar.solver.sharding.rules.contractions",
    "autopar.solver.rules_elementwise": "autopar.solver.sharding.rules.elementwise",
    "autopar.solver.rules_reductions": "autopar.solver.sharding.rules.reductions",
    "autopar.solver.rules_views": "autopar.solver.sharding.rules.views",
    "autopar.solver.saved": "autopar.solver.sharding.saved",
    "autopar.solver.stage_cost": "autopar.solver.stages.cost",
    "autopar.solver.stage_plan": "autopar.solver.stages.plan",
    "autopar.solver.strategies": "autopar.solver.sharding.strategies",
    "autopar.solver.units": "autopar.solver.cluster.units",
    "autopar.solver.v_layout": "autopar.solver.stages.v_layout",
}
# old module whose path is now a package -> the module that holds what it held
BECAME_PACKAGE = {
    "autopar.check": "autopar.check.step",
    "autopar.models": "autopar.models.resolve",
    "autopar.runtime.checkpoint": "autopar.runtime.checkpoint.save_load",
    "autopar.runtime.comm": "autopar.runtime.comm.context",
    "autopar.runtime.grads": "autopar.runtime.grads.sync",
    "autopar.solver.cluster": "autopar.solver.cluster.spec",
    "autopar.solver.sharding": "autopar.solver.sharding.solve",
    "autopar.solver.stages": "autopar.solver.stages.balance",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=3)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each old module path of ``MOVED`` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        _warn(spec.name, MOVED[spec.name])
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:  # the module at its new path is already executed
        pass


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once; ``autopar/__init__.py`` calls it)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def forward(package: str) -> Callable[[str], Any]:
    """A package's ``__getattr__`` serving the public names of the old module at the package's path."""

    def __getattr__(name: str) -> Any:
        if name.startswith("_") or importlib.util.find_spec(f"{package}.{name}") is not None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = importlib.import_module(BECAME_PACKAGE[package])
        public = getattr(target, "__all__", [n for n in vars(target) if not n.startswith("_")])
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{package}.{name}", f"{BECAME_PACKAGE[package]}.{name}")
        return getattr(target, name)

    return __getattr__


__all__ = ["BECAME_PACKAGE", "MOVED", "forward", "install"]
