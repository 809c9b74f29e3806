"""Mixed precision (runtime/build/precision.py): bf16 and fp16 training on dp=2 x tp=2 and pp=2 x dp=2 against one
process with the same policy (within the bound of docs/runtime.md, "Mixed precision"), bit for bit against
the rank simulator running the same plan, fp16's overflowing step skipped on every rank alike, and each
rank's bytes of parameters, gradients and optimizer states equal to the cost model's prediction.

One 4-rank spawn (about 25 s on 2 cores) holds every multi-process check; the references run here, on
the rank simulator.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from autopar.api import _capture
from autopar.build import plan_programs
from autopar.errors import PrecisionError
from autopar.ir.core import MeshSpec, Program
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.models.resolve import build
from autopar.passes.shard import ShardOptions
from autopar.runtime.build.params import state_keys, value_source
from autopar.runtime.build.precision import (
    LossScaler,
    LossScaling,
    MixedPrecisionPolicy,
    compute_copy,
    policy_of,
    precision_setup,
)
from autopar.runtime.call.batch import sub_microbatch
from autopar.runtime.comm.context import Comm
from autopar.runtime.grads.zero import ZeroOptimizer
from autopar.runtime.module import ParallelModule, RuntimeOptions
from autopar.runtime.sim.ranksim import SimWorld
from autopar.schedule.generators import make_schedule
from autopar.solver.sharding.cost import CostModel, TrainingSetup
from tests.equivalence import make_batches

MODEL = (
    "tiny-gpt2:n_layer=2,n_embd=32,n_head=4,vocab_size=64,n_positions=16,"
    "attn_pdrop=0,resid_pdrop=0,embd_pdrop=0,batch=8,seq=8"
)
STEPS, LR, MICROBATCHES = 3, 0.1, 2
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # u: half the distance from 1 to the next number
MESHES = {"dp2tp2": {"dp": 2, "tp": 2}, "pp2dp2": {"pp": 2, "dp": 2}}
# least memory: the plan splits the batch over dp and the matmuls over tp (the fastest plan for this tiny
# model on a CPU cluster computes everything on every rank, which would compare nothing)
OBJECTIVE = {"dp2tp2": "memory", "pp2dp2": "time"}


def model_and_batches():
    spec = build(MODEL, device="cpu", seed=0)
    return spec.model, make_batches(spec.model, spec.kwargs, STEPS)


def train(pipe, batches) -> dict:
    """``STEPS`` steps of SGD (no momentum: the masters move by lr times each step's gradient): the losses,
    each step's whole gradients (unscaled) and the whole fp32 master weights."""
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, grads = [], []
    for b in batches:
        losses.append(pipe.train_step(**b).item())
        grads.append(_copied(pipe.full_state_dict(grads=True)))
        opt.step()
        opt.zero_grad()
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "grads": grads,
        "params": _copied(pipe.full_state_dict()),
    }


def _copied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``full_state_dict`` may hand out the live tensors of whole parameters: keep their values of now."""
    return {k: v.clone() for k, v in state.items()}


# ---------------------------------------------------------------------------------------------
# The 4-rank run


def _skip_a_step(pipe, batches) -> dict:
    """fp16 on pp=2 x dp=2 (the module ``train`` trained, no step skipped): an inf put into one gradient of
    global rank 3 (last stage, a weight no other rank holds or sums) in the second of three more steps;
    every rank must skip that step (its masters unchanged, the scale halved) and train the others."""
    params = dict(pipe.named_parameters())
    poison = {"on": False}

    def overflow(p: torch.Tensor) -> None:
        if poison["on"]:
            p.grad.fill_(math.inf)

    if torch.distributed.get_rank() == 3:
        params["transformer.ln_f.weight"].register_post_accumulate_grad_hook(overflow)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    before, scales = [], []
    for i, b in enumerate(batches):
        poison["on"] = i == 1
        before.append({n: p.detach().clone() for n, p in params.items()})
        pipe.train_step(**b)
        opt.step()
        opt.zero_grad()
        scales.append(pipe.loss_scaler.scale)
    after = {n: p.detach().clone() for n, p in params.items()}
    changed = [any(not torch.equal(x[n], y[n]) for n in x) for x, y in zip(before, before[1:] + [after])]
    return {"changed": changed, "scales": scales, "skipped": pipe.loss_scaler.skipped}


def _state_bytes(autopar, model, batches) -> dict:
    """bf16 with ZeRO-1 and ZeRO-3 on dp=2 x tp=2, AdamW: (measured, predicted) bytes of this rank's
    parameters, gradients (after a backward) and optimizer states (after a step). Adam's scalar ``step``
    counters are not model states and are not counted."""
    mesh = autopar.init_mesh("cpu", dp=2, tp=2)
    out = {}
    for zero in (1, 3):
        options = ShardOptions(setup=TrainingSetup(zero=zero))
        pipe = autopar.compile(model, mesh, kwargs=batches[0], mixed_precision="bf16", options=options)
        opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-3)
        pipe(**batches[0]).loss.backward()
        params = [t for t in pipe.local_tensors().values() if isinstance(t, torch.nn.Parameter)]
        measured = [sum(p.numel() * p.element_size() for p in params)]
        measured.append(sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None))
        opt.step()
        states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        if isinstance(opt, ZeroOptimizer):  # its fp32 flat slices of the parameters it steps
            states += [f.master for f in opt.flats if f.params]
        measured.append(sum(t.numel() * t.element_size() for t in states))
        cost = CostModel(pipe.program.mesh, pipe.setup)
        predicted = [0.0, 0.0, 0.0]
        for v in pipe.program.params:
            if v.type.is_float:
                predicted = [a + b for a, b in zip(predicted, cost.state_bytes(v.type, v.type.placements))]
        dtypes = sorted({str(p.dtype) for p in params})
        out[zero] = {"measured": measured, "predicted": predicted, "dtypes": dtypes, "precision": pipe.setup.precision}
    return out


def four_ranks(rank: int, world: int) -> dict:
    import autopar

    model, batches = model_and_batches()
    out: dict = {}
    for name, axes in MESHES.items():
        mesh = autopar.init_mesh("cpu", **axes)
        options = ShardOptions(objective=OBJECTIVE[name])
        for precision in UNIT_ROUNDOFF:
            pipe = autopar.compile(
                model, mesh, kwargs=batches[0], options=options, mixed_precision=precision, microbatches=MICROBATCHES
            )
            run = train(pipe, batches)
            run["programs"] = (print_program(pipe.program), print_program(pipe.train_program))
            run["reductions"] = _reductions(pipe.train_program)
            out[f"{name},{precision}"] = run
            if name == "pp2dp2" and precision == "fp16":
                out["skip"] = _skip_a_step(pipe, batches)
    out["bytes"] = _state_bytes(autopar, model, batches)
    return out


def _reductions(program: Program) -> int:
    """R: how many reductions of activations the plan splits over ranks (each rounds its partial sums)."""
    return sum(op.target in ("all_reduce", "reduce_scatter") for op in program.ops)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from tests._dist import run_distributed

    return run_distributed(four_ranks, 4, timeout=600)


# ---------------------------------------------------------------------------------------------
# References on the rank simulator


def simulated(
    model,
    batches,
    policy,
    mesh: MeshSpec,
    programs: tuple[str, str] | None = None,
    objective: str = "time",
    microbatch_semantics: str = "exact",
) -> list[dict]:
    """Every rank's ``train`` of the plan ``programs`` (forward, training; default: planned here for
    ``mesh``) built as ``autopar.compile`` builds it, each rank a thread of this process."""
    example = sub_microbatch((), dict(batches[0]), MICROBATCHES, 1)
    captured = _capture(model, *example, policy)
    _, options = precision_setup(policy, ShardOptions(objective=objective))
    schedule = make_schedule("1f1b", 1, MICROBATCHES)
    if programs is None:
        forward, training = plan_programs(captured, mesh, schedule, options)
    else:
        forward, training = parse(programs[0]), parse(programs[1])
    get_value = value_source(model, captured, 0)
    state = state_keys(model, {v.name for v in forward.inputs if v.kind != "input"}, get_value)
    world = SimWorld(forward.mesh)
    run = RuntimeOptions(MICROBATCHES, precision=policy, microbatch_semantics=microbatch_semantics)

    def rank(r: int) -> dict:
        comm: Comm = world.comm(r)
        pipe = ParallelModule(
            forward, training, schedule, captured.in_spec, captured.out_spec, comm, get_value, "cpu",
            options.setup, run, state=state,
        )  # fmt: skip
        return train(pipe, batches) | {"synced": sorted(v.name for v in forward.params if v.attrs.get("grad_sync"))}

    return world.run(rank)


@functools.cache
def one_process(precision: str) -> dict:
    """The single-process run with the same policy (a mesh of one rank), shared by the meshes' tests."""
    model, batches = model_and_batches()
    return simulated(model, batches, policy_of(precision), MeshSpec((("one", 1),)))[0]


def _max_abs(d: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: v.abs().max().item() for k, v in d.items() if v.is_floating_point()}


@pytest.mark.multiproc
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("precision", list(UNIT_ROUNDOFF))
def test_parallel_equals_one_process_within_the_rounding_bound(ranks, mesh: str, precision: str) -> None:
    """docs/runtime.md's bound: per step s, |dL_s| <= s (R + k) u |L_s| and, per tensor, max|dg_s| <=
    s (R + k) u max|g_s|; the masters (SGD) within lr sum_s of the gradients' bound. R: split reductions of
    the plan, k: ranks summing a gradient (the world, an upper bound), u: the dtype's unit roundoff."""
    model, batches = model_and_batches()
    ref = one_process(precision)
    u = UNIT_ROUNDOFF[precision]
    worst = 0.0
    for r, got in enumerate(ranks):
        run = got[f"{mesh},{precision}"]
        factor = (run["reductions"] + 4) * u
        for s in range(STEPS):
            bound = (s + 1) * factor * abs(ref["losses"][s].item())
            diff = abs(run["losses"][s].item() - ref["losses"][s].item())
            assert diff <= bound, (r, mesh, precision, s, diff, bound)
            worst = max(worst, diff / bound)
        drift: dict[str, float] = {}
        for s in range(STEPS):
            scale = _max_abs(ref["grads"][s])
            for k, g in ref["grads"][s].items():
                diff = (run["grads"][s][k] - g).abs().max().item()
                bound = (s + 1) * factor * scale[k]
                assert diff <= bound, (r, mesh, precision, "grad", s, k, diff, bound)
                drift[k] = drift.get(k, 0.0) + LR * bound
                worst = max(worst, diff / bound if bound else 0.0)
        for k, w in ref["params"].items():
            if k in drift:
                diff = (run["params"][k] - w).abs().max().item()
                assert diff <= drift[k], (r, mesh, precision, "param", k, diff, drift[k])
        # the masters stayed fp32 and trained: not the initial weights, not the bf16-rounded ones
        assert all(v.dtype == torch.float32 for v in run["params"].values())
        assert not torch.equal(run["params"]["lm_head.weight"], model.state_dict()["lm_head.weight"])
    print(f"{mesh} {precision}: largest difference / bound {worst:.3f}")


@pytest.mark.multiproc
@pytest.mark.parametrize("precision", list(UNIT_ROUNDOFF))
def test_parallel_equals_the_rank_simulator_bit_for_bit(ranks, precision: str) -> None:
    """dp=2 x tp=2: the plan the 4 processes ran, replayed on the simulator, gives the same bits (losses,
    every step's gradients, the masters) on every rank."""
    model, batches = model_and_batches()
    run0 = ranks[0][f"dp2tp2,{precision}"]
    sim = simulated(model, batches, policy_of(precision), MeshSpec(tuple(MESHES["dp2tp2"].items())), run0["programs"])
    for r, (got, want) in enumerate(zip((x[f"dp2tp2,{precision}"] for x in ranks), sim)):
        assert torch.equal(got["losses"], want["losses"]), (r, got["losses"], want["losses"])
        for s in range(STEPS):
            assert all(torch.equal(got["grads"][s][k], g) for k, g in want["grads"][s].items()), (r, s)
        assert all(torch.equal(got["params"][k], w) for k, w in want["params"].items()), r


@pytest.mark.multiproc
def test_fp16_overflow_skips_the_step_on_every_rank(ranks) -> None:
    """Only rank 3's gradient overflowed (a weight of the last stage); the first stage's ranks skip too."""
    for r, got in enumerate(ranks):
        skip = got["skip"]
        assert skip["skipped"] == 1, (r, skip)
        assert skip["changed"] == [True, False, True], (r, skip)
        assert skip["scales"] == [2.0**16, 2.0**15, 2.0**15], (r, skip)


@pytest.mark.multiproc
def test_state_bytes_equal_the_cost_models_prediction(ranks) -> None:
    for r, got in enumerate(ranks):
        for zero, b in got["bytes"].items():
            assert b["precision"] == "bf16" and b["dtypes"] == ["torch.float32"], (r, zero, b)
            assert b["measured"] == b["predicted"], (r, zero, b)


# ---------------------------------------------------------------------------------------------
# One process


def test_gradients_are_reduced_in_reduce_dtype() -> None:
    """dp=2 on the rank simulator (least memory: the batch split, gradients summed over dp): with
    ``reduce_dtype=bf16`` every gradient the data-parallel all-reduce sums is a sum made in bf16 (each entry a
    bf16 number, after the fp32 step-1 gradients were cast), with the default fp32 none is; both within the
    bound of one process."""
    model, batches = model_and_batches()
    ref, u = one_process("bf16"), UNIT_ROUNDOFF["bf16"]
    for reduce in (torch.float32, torch.bfloat16):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
        run = simulated(model, batches, policy, MeshSpec((("dp", 2),)), objective="memory")[0]
        synced = [n for n in run["synced"] if n in run["grads"][0]]
        assert synced
        in_bf16 = [bool(run["grads"][0][n].eq(run["grads"][0][n].to(torch.bfloat16).float()).all()) for n in synced]
        assert all(in_bf16) if reduce == torch.bfloat16 else not any(in_bf16), (reduce, synced, in_bf16)
        for s in range(STEPS):
            assert abs(run["losses"][s] - ref["losses"][s]) <= (s + 1) * 2 * u * abs(ref["losses"][s]), (reduce, s)


def test_the_policy_and_its_refusals() -> None:
    assert policy_of(None) is None and policy_of("fp32") is None and policy_of(torch.float32) is None
    bf16 = policy_of("bf16")
    assert bf16 == MixedPrecisionPolicy(param_dtype=torch.bfloat16) and bf16.reduce_dtype == torch.float32
    assert bf16.scaling is None and policy_of("fp16").scaling == LossScaling()
    with pytest.raises(PrecisionError, match="use fp32, bf16 or fp16"):
        policy_of("int8")
    with pytest.raises(PrecisionError, match="floating torch.dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int8)
    _, options = precision_setup(MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=None), None)
    assert (options.setup.precision, options.setup.reduce_dtype) == ("bf16", "bf16")  # FSDP2's None
    policy, _ = precision_setup(None, ShardOptions(setup=TrainingSetup(precision="fp16", reduce_dtype="fp16")))
    assert policy.param_dtype == policy.reduce_dtype == torch.float16  # a plan's setup applies


def test_compute_copy_captures_the_bf16_program_and_keeps_the_masters() -> None:
    model, batches = model_and_batches()
    copy = compute_copy(model, torch.bfloat16)
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the user's model is untouched
    assert copy.lm_head.weight is copy.transformer.wte.weight  # ties kept
    assert copy.transformer.wte.weight.equal(model.transformer.wte.weight.to(torch.bfloat16))


class _ConvNet(torch.nn.Module):
    """A convolution, a batch norm in training mode (running statistics kept in buffers), a linear head."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Linear(8, 4)

    def forward(self, x, t):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return torch.nn.functional.mse_loss(self.head(h), t)


def test_a_batch_norm_trains_in_bf16_with_fp32_weights_and_statistics() -> None:
    """bf16 batch norms keep fp32 weights, as FSDP's MixedPrecision does: bf16 weights beside the fp32 running
    statistics were an error ("expected scalar type BFloat16 but found Float") in the capture and on the ranks.
    On dp=2 the bf16 step's losses are the fp32 model's to bf16's rounding (5 u: a handful of roundings on the
    way), and the running statistics moved as the model's do. Its batch norm couples the batch, so the
    step's microbatches are each their own batch by request (``microbatch_semantics="per_microbatch"``), as
    the reference computes them."""
    torch.manual_seed(0)
    model = _ConvNet()
    batches = [{"x": torch.randn(8, 3, 6, 6), "t": torch.randn(8, 4)} for _ in range(STEPS)]
    kept = compute_copy(model, torch.bfloat16)
    assert kept.bn.weight.dtype == torch.float32 and kept.conv.weight.dtype == torch.bfloat16
    dp2 = MeshSpec((("dp", 2),))
    run = simulated(
        copy.deepcopy(model), batches, policy_of("bf16"), dp2, objective="memory", microbatch_semantics="per_microbatch"
    )[0]
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    want = []
    for b in batches:
        loss = sum(reference(**piece) for piece in _pieces(b)) / MICROBATCHES
        want.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert torch.allclose(run["losses"], torch.tensor(want, dtype=torch.float64), rtol=5 * UNIT_ROUNDOFF["bf16"])
    mean = run["params"]["bn.running_mean"]
    assert not torch.equal(mean, model.bn.running_mean)
    assert torch.allclose(mean, reference.bn.running_mean, atol=5 * UNIT_ROUNDOFF["bf16"])


def _pieces(batch: dict) -> list[dict]:
    return [dict(zip(batch, piece)) for piece in zip(*(v.chunk(MICROBATCHES) for v in batch.values()))]


def test_loss_scaler_grows_after_good_steps_and_backs_off() -> None:
    comm = Comm(groups={}, coords={}, sizes={})
    scaler = LossScaler(LossScaling(init_scale=8.0, growth_interval=2))
    g = torch.full((3,), 16.0)
    assert scaler.seeds(None, 2, 1) == [[4.0], [4.0]]
    assert scaler.unscale([g], comm, torch.device("cpu")) and g.tolist() == [2.0] * 3 and scaler.scale == 8.0
    assert scaler.unscale([g], comm, torch.device("cpu")) and scaler.scale == 16.0  # two good steps: grow
    assert not scaler.unscale([torch.tensor([1.0, math.nan])], comm, torch.device("cpu"))
    assert scaler.scale == 8.0 and scaler.skipped == 1


def test_a_bf16_plan_file_fits_the_bf16_capture_and_refuses_fp32() -> None:
    """``autopar plan --precision bf16`` captures in bf16 as compile does: the plan's fingerprint fits the model
    compile captures under the plan's precision, not the fp32 capture; asking it for fp32 is refused."""
    from autopar.api import _check_plan_precision
    from autopar.planner import plan_model

    options = ShardOptions(setup=TrainingSetup(precision="bf16"))
    plan = plan_model(MODEL, MeshSpec((("dp", 2),)), options, baselines=()).plan
    model, batches = model_and_batches()
    policy, _ = precision_setup(None, ShardOptions(setup=TrainingSetup(**plan.options["setup"])))
    assert policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    plan.check(_capture(model, (), batches[0], policy), MeshSpec((("dp", 2),)))
    with pytest.raises(Exception, match="another graph"):
        plan.check(_capture(model, (), batches[0], None), MeshSpec((("dp", 2),)))
    with pytest.raises(PrecisionError, match="made for bf16 compute"):
        _check_plan_precision(plan, None)
