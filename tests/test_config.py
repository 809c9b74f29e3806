"""TrainConfig (autopar/config.py): one configuration for compile, `autopar plan` and plan files; the option
types derived from it; the spellings before it deprecated but working; the module paths before the folders
(autopar/_moved.py). One process (a one-rank gloo group for compile), ~20 s."""

from __future__ import annotations

import copy
import importlib
import json
import sys
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.cli import main as cli_main
from autopar.config import TrainConfig, field_names
from autopar.errors import BatchError, ConfigError, PrecisionError, ScheduleError
from autopar.ir.printer import print_program
from autopar.passes.shard import ShardOptions
from autopar.plan import Plan
from autopar.runtime.build.precision import MixedPrecisionPolicy
from autopar.solver.sharding.cost import TrainingSetup

ROOT = Path(__file__).resolve().parent.parent
jsonschema = pytest.importorskip("jsonschema")


class TwoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def batch(rows: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(rows, 8, generator=g, dtype=torch.float64),
        "y": torch.randn(rows, 1, generator=g).double(),
    }


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield autopar.init_mesh(dp=1)
    finally:
        dist.destroy_process_group()


def test_the_facade_exports_the_configuration_and_checkpoints():
    for name in ("compile", "init_mesh", "TrainConfig", "MixedPrecisionPolicy", "Plan", "ClusterSpec", "checkpoint"):
        assert name in autopar.__all__ and hasattr(autopar, name), name
    assert autopar.checkpoint.save.__module__ == "autopar.runtime.checkpoint.save_load"
    assert autopar.checkpoint.save_safetensors.__module__ == "autopar.runtime.checkpoint.safetensors_io"


def test_every_layer_reads_its_options_from_the_one_config():
    cfg = TrainConfig(
        objective="memory", alpha=2.0, budget="3GiB", zero=2, mics_group=2, bucket_cap_mb=4, precision="bf16",
        schedule="interleaved", schedule_options={"chunks": 2}, microbatches=4, batch="local", data_parallel="inputs",
        sub_pipeline_tp=True, timeout=30.0, record=False, optimizer="sgd", solver="highs", time_limit=5.0,
        torch_compile=True,
    )  # fmt: skip
    setup = cfg.training_setup()
    assert setup == TrainingSetup(
        optimizer="sgd", precision="bf16", reduce_dtype="fp32", zero=2, mics_group=2, bucket_cap_mb=4
    )
    opts = cfg.shard_options()
    assert (opts.objective, opts.alpha, opts.budget_bytes, opts.backend, opts.time_limit) == (
        "memory", 2.0, 3 * 2**30, "highs", 5.0,
    )  # fmt: skip
    assert (opts.setup, opts.batch, opts.data_parallel) == (setup, "local", "inputs")
    run = cfg.runtime_options()
    assert (run.microbatches, run.timeout, run.record, run.sub_pipeline_tp, run.batch) == (
        4,
        30.0,
        False,
        True,
        "local",
    )
    assert run.precision == MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert run.torch_compile and not TrainConfig().runtime_options().torch_compile
    assert cfg.schedule_kwargs() == {"chunks": 2}
    assert TrainConfig(recompute=True).schedule_kwargs() == {"recompute": 1}
    # a ShardOptions given as the base keeps its internal fields (the baselines' constraints)
    base = ShardOptions(constrain={"fc1.weight": lambda p: True}, pin_constrained=True)
    derived = cfg.shard_options(base=base)
    assert derived.constrain is base.constrain and derived.pin_constrained and derived.setup == setup


def test_the_config_round_trips_through_yaml_and_json(tmp_path):
    cfg = TrainConfig(
        zero=3, zero_axes=("dp",), precision=MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.bfloat16),
        schedule="scp", schedule_options={"alpha1": Fraction(1, 4)}, microbatches=8,
        loss_weight=None, cluster="dgx-a100",
    )  # fmt: skip
    for name in ("train.yaml", "train.json"):
        cfg.save(tmp_path / name)
        assert TrainConfig.load(tmp_path / name) == cfg, name
    assert json.loads((tmp_path / "train.json").read_text())["precision"]["param_dtype"] == "bf16"
    (tmp_path / "hand.yaml").write_text("zero: 2\nmicrobatches: 4\nprecision: bf16\nschedule: gpipe\n")
    assert TrainConfig.load(tmp_path / "hand.yaml") == TrainConfig(
        zero=2, microbatches=4, precision="bf16", schedule="gpipe"
    )


def test_bad_choices_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown fields \['zero_stage'\].*zero,"):
        TrainConfig.from_dict({"zero_stage": 2})
    with pytest.raises(ConfigError, match="zero must be one of 0, 1, 2, 3, not 5"):
        TrainConfig(zero=5)
    with pytest.raises(ConfigError, match="zero must be one of"):
        TrainConfig(zero=True)
    with pytest.raises(ConfigError, match="microbatches must be a positive integer"):
        TrainConfig(microbatches=0)
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'; known: 1f1b, dualpipev"):
        TrainConfig(schedule="pipedream")
    with pytest.raises(ScheduleError, match="the 1f1b schedule takes no option chunks; it takes recompute"):
        TrainConfig(schedule_options={"chunks": 2})
    with pytest.raises(ScheduleError, match="recompute=True needs a schedule that recomputes .*not interleaved"):
        TrainConfig(schedule="interleaved", recompute=True)
    with pytest.raises(PrecisionError, match="use fp32, bf16 or fp16"):
        TrainConfig(precision="int8")
    with pytest.raises(BatchError, match="batch must be 'global'"):
        TrainConfig(batch="per-rank")
    with pytest.raises(BatchError, match="loss_weight must be"):
        TrainConfig(loss_weight="mean")
    with pytest.raises(ConfigError, match="budget"):
        TrainConfig(budget="lots")
    with pytest.raises(ConfigError, match="a loss_weight function cannot be written"):
        TrainConfig(loss_weight=lambda inputs: 1.0).to_dict()
    (tmp_path / "bad.yaml").write_text("zero: [2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        TrainConfig.load(tmp_path / "bad.yaml")


def _step(model) -> tuple[float, dict[str, torch.Tensor]]:
    opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
    loss = float(model.train_step(**batch()))
    opt.step()
    return loss, {k: v.clone() for k, v in model.full_state_dict().items()}


def test_compile_takes_the_config_its_fields_and_the_old_spellings_alike(one_rank_mesh):
    """config=, the same fields as keywords, and the deprecated options=/mixed_precision= plan and train the
    same module: equal programs, schedule, setup, and an equal float64 training step."""
    torch.manual_seed(0)
    reference = TwoLinear().double()
    kw = {"kwargs": batch(), "seed": 0}

    def compiled(**how):
        return autopar.compile(copy.deepcopy(reference), one_rank_mesh, **kw, **how)

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new spellings warn of nothing
        by_config = compiled(config=TrainConfig(zero=1, microbatches=2, schedule="gpipe", record=False))
        by_fields = compiled(zero=1, microbatches=2, schedule="gpipe", record=False)
        mixed = compiled(config=TrainConfig(zero=1), microbatches=2, schedule="gpipe", record=False)
    with pytest.warns(DeprecationWarning, match=r"compile\(options=ShardOptions"):
        old = compiled(
            options=ShardOptions(setup=TrainingSetup(zero=1)), microbatches=2, schedule="gpipe", record=False
        )
    first = _step(by_config)
    for other in (by_fields, mixed, old):
        assert print_program(other.program) == print_program(by_config.program)
        assert other.schedule.to_text() == by_config.schedule.to_text()
        assert other.setup == by_config.setup and other.setup.zero == 1
        loss, params = _step(other)
        assert loss == first[0] and all(torch.equal(params[k], first[1][k]) for k in params)
    assert by_config.schedule.name == "gpipe" and by_config.schedule.num_microbatches == 2
    with pytest.warns(DeprecationWarning, match=r"compile\(mixed_precision"):
        bf16 = compiled(mixed_precision="bf16")
    assert bf16.setup.precision == "bf16"
    with pytest.raises(ConfigError, match=r"compile\(\): unknown TrainConfig fields \['zero_stage'\]"):
        compiled(zero_stage=2)


def test_a_plan_file_keeps_its_config_and_compile_starts_from_it(one_rank_mesh, tmp_path, monkeypatch):
    """`autopar plan --config` writes the config into the plan; compile(plan=) runs its microbatches and ZeRO
    stage unless told otherwise; a flag overrides the file. (A plan is made for one microbatch's shapes: the
    model file's batch of 8 rows; compile is given the step's batch.)"""
    model_file = tmp_path / "two_linear.py"
    model_file.write_text(
        "import torch\nfrom tests.test_config import TwoLinear, batch\n"
        "def make():\n    return TwoLinear().double(), (), batch()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "train.yaml").write_text("zero: 1\nmicrobatches: 2\nobjective: memory\n")
    plan_path = tmp_path / "plan.json"
    spec = f"{model_file}:make"
    argv = ["plan", spec, "--mesh", "dp=1", "--config", str(tmp_path / "train.yaml"), "--no-baselines", "--json"]
    assert cli_main([*argv, "--microbatches", "4", "-o", str(plan_path)]) == 0
    plan = Plan.load(plan_path)
    assert plan.config["zero"] == 1 and plan.config["microbatches"] == 4  # the flag over the file
    schema = json.loads((ROOT / "docs" / "plan.schema.json").read_text())
    assert set(schema["$defs"]["config"]["properties"]) == set(field_names())  # the schema knows every field
    jsonschema.validate(json.loads(plan_path.read_text()), schema)
    assert plan.options["objective"] == "memory" and plan.options["setup"]["zero"] == 1
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        module = autopar.compile(TwoLinear().double(), one_rank_mesh, kwargs=batch(32), plan=plan_path)
        assert module.schedule.num_microbatches == 4 and module.setup.zero == 1
        module = autopar.compile(TwoLinear().double(), one_rank_mesh, kwargs=batch(16), plan=plan_path, microbatches=2)
        assert module.schedule.num_microbatches == 2 and module.setup.zero == 1


def test_the_module_paths_before_the_folders_still_import_with_a_warning():
    for old, new, name in [
        ("autopar.runtime.schedules", "autopar.schedule.generators", "make_schedule"),
        ("autopar.solver.pipeline_shape", "autopar.schedule.placement", "stage_ranks"),
        ("autopar.runtime.safetensors_io", "autopar.runtime.checkpoint.safetensors_io", "save_safetensors"),
        ("autopar.solver.cost", "autopar.solver.sharding.cost", "TrainingSetup"),
    ]:
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
            module = importlib.import_module(old)
        assert getattr(module, name) is getattr(importlib.import_module(new), name)
    from autopar.runtime import checkpoint  # a module of 0.1, a package now: its names forwarded

    with pytest.warns(DeprecationWarning, match="autopar.runtime.checkpoint.save moved to"):
        assert checkpoint.save is autopar.checkpoint.save
    from autopar.runtime.checkpoint import pieces  # its submodules import as ever, without a warning

    assert pieces.__name__ == "autopar.runtime.checkpoint.pieces"
    with pytest.raises(AttributeError):
        checkpoint.no_such_name  # noqa: B018
