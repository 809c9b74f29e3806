"""Faults and bad input (issue 34): no checkpoint lost to a killed save, ``latest`` past a damaged one,
out-of-vocabulary ids and labels, plan files that cannot run code, bounded waits, agreed errors,
non-finite steps, named errors instead of internal tracebacks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._dist import forkserver


@contextlib.contextmanager
def _one_process():
    """This process as a world of one (gloo), for a single-process ParallelModule."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mlp_run():
    """tiny-mlp compiled for one process, its optimizer, and its batch (one step trained)."""
    import autopar
    from autopar.models.resolve import build

    spec = build("tiny-mlp", device="cpu", seed=0)
    pipe = autopar.compile(spec.model, autopar.init_mesh("cpu", dp=1), args=spec.args, kwargs=spec.kwargs)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2)
    pipe.train_step(*spec.args, **spec.kwargs)
    return pipe, opt, spec


# -- checkpoints: a killed save loses nothing; latest passes over a damaged one --------------------------------

KILL_POINTS = ("committing", "replacing")  # after every file is written, before the manifest; between renames


def _save_then_block(root: str, where: str) -> None:
    """Save to ``root/last`` at step 1, train two steps (the reference losses), then save to the same folder
    again and block at the kill point ``where`` (a file says it got there) until the test kills this process."""
    from autopar.runtime.checkpoint import files
    from autopar.runtime.checkpoint import save_load as checkpoint

    root_path = Path(root)
    ready = root_path / f"ready-{where}"

    def block(*_args, **_kwargs):
        ready.write_text("blocked")
        time.sleep(600)

    with _one_process():
        pipe, opt, spec = _mlp_run()
        checkpoint.save(root_path / "last", pipe, opt, step=1)
        losses = [pipe.train_step(*spec.args, **spec.kwargs).item() for _ in range(2)]
        (root_path / "reference.json").write_text(json.dumps(losses))
        if where == "committing":  # DCP wrote every file into the staging folder; no manifest yet
            checkpoint.commit = block
        else:  # the old checkpoint moved aside, the new one not yet renamed into place
            rename, calls = os.rename, []

            def second_blocks(src, dst):
                calls.append(src)
                if len(calls) == 2:
                    block()
                rename(src, dst)

            files.os.rename = second_blocks
        checkpoint.save(root_path / "last", pipe, opt, step=3)
    os._exit(0)  # the save finished without reaching the kill point: the test sees no ready file


@pytest.mark.multiproc
@pytest.mark.parametrize("where", KILL_POINTS)
def test_a_save_killed_over_the_previous_checkpoint_leaves_it_loadable(tmp_path, where):
    """SIGKILL during a save into the folder of the previous checkpoint (``ckpt/last``): ``latest`` still
    finds the previous one and training resumed from it gives the uninterrupted run's losses exactly.
    Before staged saves the first save's manifest was deleted before writing, so ``latest`` returned None.
    Cost: one forked process and two compiles of tiny-mlp per kill point."""
    from autopar.runtime.checkpoint import save_load as checkpoint

    proc = forkserver().Process(target=_save_then_block, args=(str(tmp_path), where))
    proc.start()
    ready = tmp_path / f"ready-{where}"
    while not ready.exists() and proc.is_alive():
        time.sleep(0.05)
    assert ready.exists(), f"the save finished without reaching the kill point {where!r}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    reference = json.loads((tmp_path / "reference.json").read_text())

    found = checkpoint.latest(tmp_path)
    assert found is not None, "the killed save lost the previous checkpoint"
    with _one_process():
        pipe, opt, spec = _mlp_run()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "replacing": load says it reads the checkpoint moved aside
            checkpoint.load(tmp_path / "last", pipe, opt)
        resumed = [pipe.train_step(*spec.args, **spec.kwargs).item() for _ in range(2)]
        assert resumed == reference
        # the next save to the same folder recovers it and replaces it whole
        checkpoint.save(tmp_path / "last", pipe, opt, step=5)
        assert checkpoint.latest(tmp_path) == tmp_path / "last"
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_latest_passes_over_a_damaged_checkpoint_and_load_of_none_is_named(tmp_path):
    """A committed newest checkpoint with a truncated shard is passed over (a warning names it) for the intact
    one before; ``load(None)`` and ``load(latest(empty))`` raise ``CheckpointError``. Before: latest returned
    the damaged one and load(None) raised a bare TypeError. Cost: one process, one compile of tiny-mlp."""
    from autopar.errors import CheckpointError
    from autopar.runtime.checkpoint import save_load as checkpoint

    with _one_process():
        pipe, opt, _ = _mlp_run()
        first = checkpoint.save(tmp_path / "step-1", pipe, opt, step=1)
        second = checkpoint.save(tmp_path / "step-2", pipe, opt, step=2)
        assert checkpoint.latest(tmp_path) == second
        shard = sorted(second.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:-7])
        with pytest.warns(UserWarning, match="damaged checkpoint .*step-2.*truncated"):
            assert checkpoint.latest(tmp_path) == first
        with pytest.warns(UserWarning, match="damaged checkpoint .*step-2.*truncated"):
            assert checkpoint.latest(tmp_path, checksums=False) == first
        checkpoint.load(first, pipe, opt)
        with pytest.raises(CheckpointError, match="got None"):
            checkpoint.load(None, pipe, opt)
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(CheckpointError, match="got None"):
            checkpoint.load(checkpoint.latest(empty), pipe, opt)
        # a folder holding other files is not replaced (that would delete them)
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "todo.txt").write_text("keep me")
        with pytest.raises(CheckpointError, match="not a checkpoint's"):
            checkpoint.save(tmp_path / "notes", pipe, opt, step=3)
        assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


# -- out-of-range token ids and labels raise at the lookup on every plan -------------------------------------


def _ranks_raise(sim, kwargs) -> list[str]:
    """Each simulated rank's train_step on ``kwargs``: the name and message of what it raised."""

    def step(module):
        try:
            module.train_step(**kwargs)
        except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
            return f"{type(e).__name__}: {e}"
        return "no error"

    return sim.run(step)


def test_out_of_vocabulary_ids_and_labels_raise_on_a_vocabulary_split_plan():
    """Megatron's plan on tp=2 splits the embedding and the logits by vocabulary: an id >= vocab or negative,
    and a label >= vocab, raise ``InputRangeError`` (an ``IndexError``, as eager) on every rank, and an ignored
    label (-100) does not. Before: each rank read the id as a zero row and the step returned a normal loss.
    Cost: one plan of tiny-gpt2 on two simulated ranks."""
    from autopar.check.simtrain import SimCompiled
    from autopar.ir.core import MeshSpec
    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.solver.sharding.baselines import megatron_options

    spec = build("tiny-gpt2", device="cpu", seed=0)
    mesh = MeshSpec((("tp", 2),))
    opts = megatron_options(lower(capture(spec.model, spec.args, spec.kwargs), mesh))
    sim = SimCompiled.of(spec.model, mesh, spec.args, spec.kwargs, options=opts)
    targets = {t for m in sim.modules for gm in m.stage_modules.values() for t in _targets(gm)}
    assert "vocab_parallel_embedding" in targets, targets  # the plan splits the table by vocabulary
    sim.make_optimizer(torch.optim.SGD, lr=0.1)
    vocab = spec.model.config.vocab_size
    ignored = spec.kwargs["labels"].clone()
    ignored[0, :3] = -100
    assert _ranks_raise(sim, {**spec.kwargs, "labels": ignored}) == ["no error"] * 2
    for name, bad in (("input_ids", vocab), ("input_ids", -1)):
        kwargs = {k: v.clone() for k, v in spec.kwargs.items()}
        kwargs[name][1, 5] = bad
        outcomes = _ranks_raise(sim, kwargs)
        # the batch's own check (runtime/call/validate.py) finds it first; the lookup's is checked below
        assert all(o.startswith("InputRangeError: input 'input_ids': 1 token ids outside [0, 128)") for o in outcomes)
    labels = spec.kwargs["labels"].clone()
    labels[1, 5] = vocab + 3  # the batch's check; this plan gathers the logits (eager's loss would raise too)
    outcomes = _ranks_raise(sim, {**spec.kwargs, "labels": labels})
    assert all(o.startswith("InputRangeError: input 'labels': 1 labels outside [0, 128)") for o in outcomes), outcomes

    # the vocabulary-parallel loss (logits split by class) checks its labels the same way, ignore_index aside
    from autopar.errors import InputRangeError
    from autopar.runtime.comm.context import use_comm
    from autopar.runtime.comm.vocab_parallel import vocab_parallel_cross_entropy
    from autopar.runtime.sim.ranksim import SimWorld

    world = SimWorld(mesh)
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))

    def loss(rank: int, target: torch.Tensor) -> str:
        c = world.comm(rank)
        with use_comm(c):
            try:
                local = logits[:, 5 * c.coords["tp"] : 5 * (c.coords["tp"] + 1)]
                return f"{float(vocab_parallel_cross_entropy(local, target, ['tp'], classes=10)):.12f}"
            except InputRangeError as e:
                return str(e)

    from autopar.runtime.comm.vocab_parallel import vocab_parallel_embedding

    table = torch.randn(10, 3, generator=torch.Generator().manual_seed(1))

    def lookup(rank: int, ids: torch.Tensor) -> str:
        c = world.comm(rank)
        with use_comm(c):
            try:
                local = table[5 * c.coords["tp"] : 5 * (c.coords["tp"] + 1)]
                return str(vocab_parallel_embedding(local, ids, ["tp"], vocab=10).sum().item() is not None)
            except InputRangeError as e:
                return str(e)

    assert world.run(lambda r: lookup(r, torch.tensor([0, 9, 4]))) == ["True"] * 2
    for bad in (10, -1):
        outcomes = world.run(lambda r, bad=bad: lookup(r, torch.tensor([0, bad, 4])))
        assert all(o.startswith("1 token ids are outside [0, 10)") for o in outcomes), outcomes

    good = torch.tensor([0, 9, -100, 3, 4, 5])
    assert world.run(lambda r: loss(r, good)) == [f"{float(torch.nn.functional.cross_entropy(logits, good)):.12f}"] * 2
    for bad in (10, -2):
        outcomes = world.run(lambda r, bad=bad: loss(r, torch.tensor([0, 9, bad, 3, 4, 5])))
        assert all(o.startswith("1 labels are outside [0, 10)") for o in outcomes), outcomes
    assert issubclass(InputRangeError, IndexError)


def _targets(gm) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


# -- plan files are data: edited programs are refused before anything runs them ------------------------------


def _plan_file(tmp_path, preset: str, mesh: str) -> Path:
    from autopar.cli import main

    path = tmp_path / f"{preset}-{mesh.replace(',', '-').replace('=', '')}.json"
    assert main(["plan", preset, "--mesh", mesh, "--no-baselines", "--precision", "fp32", "-o", str(path)]) == 0
    return path


def _loss_line(path: Path) -> str:
    """The plan program's loss op (its text up to the cost comment), whatever placement the plan gave it."""
    line = next(ln for ln in json.loads(path.read_text())["program"].splitlines() if "= aten.mse_loss(" in ln)
    return line.split("  #")[0]


def _edit_program(path: Path, old: str, new: str) -> Path:
    data = json.loads(path.read_text())
    assert old in data["program"], old
    data["program"] = data["program"].replace(old, new, 1)
    edited = path.with_name("edited-" + path.name)
    edited.write_text(json.dumps(data))
    return edited


FROM_FILE = "%ev : f32[4] {{{rep}}} = aten.from_file('{marker}', False, 4) {{dtype=torch.float32}}\n"


def test_an_edited_plan_program_is_refused_and_never_run(tmp_path, capsys):
    """A plan whose program gains ``aten.from_file`` (fingerprint kept) is refused by ``compile(plan=...)`` and by
    ``autopar check --plan``, and the verifier refuses to run it; an added random op or in-place write too; a
    program over another mesh than the plan's is refused by ``check`` (it printed "agrees on mesh [dp=4, tp=1]"
    and exited 0) and ``compile``; a parameter placement edited so that whole shapes still agree (it passed
    ``verify(shapes=True)``) is a ``PlacementError`` naming the op and its shards (before: a traceback in the
    generated code). Cost: two plans of tiny-mlp, one compile attempt per edit (refused early)."""
    import autopar
    from autopar.api import parse_mesh
    from autopar.check.step import check_model
    from autopar.cli import main
    from autopar.errors import PlacementError, PlanError, VerifyError
    from autopar.ir.parser import parse
    from autopar.ir.verify import verify
    from autopar.models.resolve import build

    marker = tmp_path / "secret.bin"
    marker.write_bytes(b"\0" * 16)
    one = _plan_file(tmp_path, "tiny-mlp", "dp=1")
    loss = _loss_line(one)
    edits = {
        "from_file": (loss, FROM_FILE.format(marker=marker, rep="R") + loss, "reads or writes memory outside"),
        "random": (loss, "%ev : f32[4,8,16] {R} = aten.rand_like(%16)\n" + loss, "draws random numbers"),
        "in place": (loss, "%ev : f32[4,8,16] {R} = aten.add_.Tensor(%x, %16)\n" + loss, "writes one of its"),
    }
    spec = build("tiny-mlp", device="cpu", seed=0)
    with _one_process():
        mesh = autopar.init_mesh("cpu", dp=1)
        for name, (old, new, effect) in edits.items():
            edited = _edit_program(one, old, new)
            with pytest.raises(PlanError, match=f"{effect}.*never emits"):
                autopar.compile(spec.model, mesh, args=spec.args, kwargs=spec.kwargs, plan=str(edited))
            if name == "from_file":
                with pytest.raises(VerifyError, match="not run to check its shape"):
                    verify(parse(json.loads(edited.read_text())["program"]), shapes=True)
        with pytest.raises(PlanError, match=r"program is over mesh \[dp=2\] but the plan says \[dp=1\]"):
            wider = _edit_program(one, "mesh @m = [dp=1]", "mesh @m = [dp=2]")
            autopar.compile(spec.model, mesh, args=spec.args, kwargs=spec.kwargs, plan=str(wider))
        autopar.compile(spec.model, mesh, args=spec.args, kwargs=spec.kwargs, plan=str(one))  # the plan as written

    four = _plan_file(tmp_path, "tiny-mlp", "dp=2,tp=2")
    other_mesh = _edit_program(four, "mesh @m = [dp=2, tp=2]", "mesh @m = [dp=4, tp=1]")
    capsys.readouterr()
    assert main(["check", "tiny-mlp", "--mesh", "dp=2,tp=2", "--plan", str(other_mesh)]) == 2
    err = capsys.readouterr().err
    assert "program is over mesh [dp=4, tp=1] but the plan says [dp=2, tp=2]" in err, err
    loss4 = _loss_line(four)
    evil = _edit_program(four, loss4, FROM_FILE.format(marker=marker, rep="R,R") + loss4)
    assert main(["check", "tiny-mlp", "--mesh", "dp=2,tp=2", "--plan", str(evil)]) == 2
    assert "aten.from_file" in capsys.readouterr().err

    # a parameter's placement edited by hand: whole shapes still agree (the verifier passed it), but on a rank the
    # bias add reads a [16] shard of the matmul and the whole [32] bias (before: a traceback in generated code)
    unsplit = _edit_program(four, "param %fc_in.bias : f32[32] {R,S(0)}", "param %fc_in.bias : f32[32] {R,R}")
    verify(parse(json.loads(unsplit.read_text())["program"]), shapes=True)
    four_ranks = parse_mesh("dp=2,tp=2")
    with pytest.raises(PlacementError, match=r"%1 = aten.add.Tensor cannot run on one rank's shards: it reads "):
        check_model(spec.model, spec.args, spec.kwargs, four_ranks, plan=str(unsplit))
    assert main(["check", "tiny-mlp", "--mesh", "dp=2,tp=2", "--plan", str(unsplit)]) == 2
    err = capsys.readouterr().err
    assert "%fc_in.bias [32] {R,R}" in err and "plan again (`autopar plan`) rather than edit placements" in err, err


# -- every wait bounded: a stuck peer is named on every rank that waited for it ------------------------------

STUCK = 3  # the rank that stops itself (not rank 0: it serves the job's store)


def _ranks_of_a_stuck_peer(rank: int, world: int, port: int, out: str, timeout: float) -> None:
    """One rank of dp=2 x tp=2 (tiny-gpt2, gloo): a step, then rank ``STUCK`` stops itself (SIGSTOP: alive,
    stuck) and the others take a second step; each writes what it raised."""
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result = Path(out) / f"{rank}.json"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        import autopar
        from autopar.models.resolve import build

        spec = build("tiny-gpt2", device="cpu", seed=0)
        mesh = autopar.init_mesh("cpu", dp=2, tp=2, timeout=timeout)
        # least redundant memory: the weights split over tp, the batch over dp (the fastest plan of so tiny a
        # model computes everything on every rank and never communicates)
        pipe = autopar.compile(spec.model, mesh, kwargs=spec.kwargs, objective="memory")
        pipe.make_optimizer(torch.optim.SGD, lr=0.1)
        pipe.train_step(**spec.kwargs)
        dist.barrier()
        if rank == STUCK:
            os.kill(os.getpid(), signal.SIGSTOP)
        t0 = time.perf_counter()
        try:
            for _ in range(3):  # the gradients' all-reduce of a step may be waited for at the next
                pipe.train_step(**spec.kwargs)
            outcome = "no error"
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            outcome = f"{type(e).__name__}: {e}"
        result.write_text(json.dumps({"seconds": time.perf_counter() - t0, "outcome": outcome}))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        result.write_text(json.dumps({"seconds": -1, "outcome": f"setup failed: {e}\n{traceback.format_exc()}"}))
    os._exit(0)


@pytest.mark.multiproc
def test_a_stuck_rank_on_dp_tp_stops_every_other_rank_with_a_named_error(tmp_path):
    """dp=2 x tp=2 on four gloo ranks, ``init_mesh(timeout=5)``: rank 3 is SIGSTOPped before a step; ranks 0, 1
    and 2 each raise ``RuntimeCommError`` naming the axis, the op and who did not arrive (rank 3 for the ranks
    sharing a group with it), bounded by the timeout (plus the grace to agree on who arrived) instead of
    waiting forever. Before: DeviceMesh's sub-groups had the 30-minute default and every rank waited.
    Cost: one spawn of four processes, one compile of tiny-gpt2."""
    from tests._dist import _free_port

    ctx, port, timeout = forkserver(), _free_port(), 5.0
    procs = [ctx.Process(target=_ranks_of_a_stuck_peer, args=(r, 4, port, str(tmp_path), timeout)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        for r, p in enumerate(procs):
            if r != STUCK:
                p.join(240)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
    results = {}
    for r in range(4):
        if r != STUCK:
            assert (tmp_path / f"{r}.json").exists(), f"rank {r} neither finished nor failed: it hung"
            results[r] = json.loads((tmp_path / f"{r}.json").read_text())
    for r, res in results.items():
        outcome = res["outcome"]
        assert outcome.startswith("RuntimeCommError: "), results
        assert f"rank {r}: the " in outcome and "over mesh axis '" in outcome, (r, outcome)
        assert "did not arrive" in outcome or "every member arrived" in outcome, (r, outcome)
        # within the timeout, the grace to agree on who arrived (at most 10 s) and a margin for a loaded machine
        assert 0 < res["seconds"] < timeout + 10.0 + 15.0, (r, res)
    # the ranks sharing a group with the stuck one name it (tp: rank 2, dp: rank 1)
    assert any(f"rank {STUCK} did not arrive" in res["outcome"] for res in results.values()), results
    print(json.dumps(results, indent=1))


# -- one failure, every rank told ------------------------------------------------------------------------------


def _every_rank_told(rank: int, world: int) -> dict:
    """dp=2, tiny-gpt2, local batches: a planning failure on rank 0 only, then a label out of range in rank
    0's rows only; what each rank raised, and the loss of a good step after (no collective left mismatched)."""
    import autopar
    import autopar.api
    from autopar.data import local_batch
    from autopar.errors import SolverError
    from autopar.models.resolve import build

    spec = build("tiny-gpt2", device="cpu", seed=0)
    mesh = autopar.init_mesh("cpu", dp=2)
    out = {}
    real = autopar.api.plan_programs
    if rank == 0:  # only rank 0 plans: only its planning can fail

        def failing(*_args, **_kwargs):
            raise SolverError("the ILP found no strategy (made to fail by the test)")

        autopar.api.plan_programs = failing
    try:
        autopar.compile(spec.model, mesh, kwargs=spec.kwargs, batch="local")
        out["planning"] = "no error"
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        out["planning"] = f"{type(e).__name__}: {e}"
    autopar.api.plan_programs = real
    pipe = autopar.compile(spec.model, mesh, kwargs=spec.kwargs, batch="local")
    pipe.make_optimizer(torch.optim.SGD, lr=0.1)
    mine = local_batch(pipe, spec.kwargs)
    bad = {k: v.clone() for k, v in mine.items()}
    if rank == 0:
        bad["labels"][0, 3] = spec.model.config.vocab_size + 5
    try:
        pipe.train_step(**bad)
        out["label"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["label"] = f"{type(e).__name__}: {e}"
    out["after"] = float(pipe.train_step(**mine))
    out.update(_nan_rows(rank))
    out["member_failed"] = _a_collective_member_raises(rank)
    out["peer_failed"] = _a_stage_raises(rank)  # last: rank 0 leaves a receive from rank 1 unfinished
    return out


def _a_collective_member_raises(rank: int) -> dict:
    """tiny-mlp on tp=2 (weights split: all-reduces in the forward) and on dp=2 (the gradients' all-reduce), the
    mesh's groups under init_mesh(timeout=PEER_TIMEOUT): a good step, then rank 1's forward (tp) or backward (dp)
    raises while rank 1 lives on; what each rank raised, and after how many seconds."""
    import autopar
    from autopar.models.resolve import build
    from autopar.runtime.execute.executor import Executor

    spec = build("tiny-mlp", device="cpu", seed=0)
    out = {}
    for axis, hook in (("tp", "_forward"), ("dp", "_backward")):
        mesh = autopar.init_mesh("cpu", timeout=PEER_TIMEOUT, **{axis: 2})
        pipe = autopar.compile(spec.model, mesh, args=spec.args, kwargs=spec.kwargs, objective="memory")
        pipe.make_optimizer(torch.optim.SGD, lr=0.1)
        pipe.train_step(*spec.args, **spec.kwargs)
        real = getattr(Executor, hook)
        if rank == 1:

            def broken(self, a, waited, axis=axis):
                raise ValueError(f"injected: a bug in rank 1's step on {axis}")

            setattr(Executor, hook, broken)
        dist.barrier()
        t0 = time.perf_counter()
        try:
            pipe.train_step(*spec.args, **spec.kwargs)
            raised = "no error"
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            raised = f"{type(e).__name__}: {e}"
        out[axis] = {"raised": raised, "seconds": time.perf_counter() - t0}
        setattr(Executor, hook, real)
        dist.barrier()  # rank 1 alive until rank 0 has raised (the world group is not the mesh's)
    return out


PEER_TIMEOUT = 60.0  # compile(timeout=) of the pipeline case: a survivor told promptly stops well within it


def _a_stage_raises(rank: int) -> dict:
    """tiny-gpt2 on pp=2: a good step, then rank 1's first backward raises (an injected bug in a stage) and
    rank 1 stays alive (it caught its error, as a training script's ``except`` or its cleanup does); what each
    rank raised, and after how many seconds."""
    import autopar
    from autopar.models.resolve import build
    from autopar.runtime.execute.executor import Executor

    spec = build("tiny-gpt2", device="cpu", seed=0)
    mesh = autopar.init_mesh("cpu", pp=2)
    pipe = autopar.compile(spec.model, mesh, kwargs=spec.kwargs, microbatches=2, schedule="1f1b", timeout=PEER_TIMEOUT)
    pipe.make_optimizer(torch.optim.SGD, lr=0.1)
    pipe.train_step(**spec.kwargs)
    if rank == 1:

        def broken(self, a, waited):
            raise ValueError("injected: a bug in stage 1's backward")

        Executor._backward = broken
    dist.barrier()
    t0 = time.perf_counter()
    try:
        pipe.train_step(**spec.kwargs)
        raised = "no error"
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        raised = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    # rank 1 stays alive until rank 0 has raised (its death would tell rank 0 instead of its published error), told
    # through the world's store (before: a sleep of 15 s and more). Polled, not store.wait: a blocking wait would
    # hold the store's client, which rank 1's watcher thread needs to end rank 0's receive (runtime/comm/watch.py)
    store, key = dist.distributed_c10d._get_default_store(), "tests.test_faults._a_stage_raises: rank 0 raised"
    if rank == 0:
        store.set(key, "1")
    deadline = time.monotonic() + PEER_TIMEOUT  # rank 0 never raised: its seconds say so
    with contextlib.suppress(dist.DistError):  # the store is gone: rank 0, which holds it, has raised and left
        while rank == 1 and not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"raised": raised, "seconds": seconds}


def _nan_rows(rank: int) -> dict:
    """tiny-mlp on dp=2 with local batches, a NaN in rank 0's rows only, under each ``on_nonfinite``: whether
    every parameter is unchanged by the step (both ranks), what was raised or warned."""
    import warnings as w

    import autopar
    from autopar.data import local_batch
    from autopar.models.resolve import build
    from autopar.runtime.grads import nonfinite

    spec = build("tiny-mlp", device="cpu", seed=0)
    mesh = autopar.init_mesh("cpu", dp=2)
    flags = []  # the check's all-reduces of its flag: none where every rank holds the same summed gradients
    counting = nonfinite.guarded
    nonfinite.guarded = lambda *a, **k: (flags.append(a[2]), counting(*a, **k))[1]
    out = {}
    for policy, clip in (("warn_skip", None), ("skip", 1.0), ("raise", None)):
        pipe = autopar.compile(spec.model, mesh, args=spec.args, kwargs=spec.kwargs, batch="local", on_nonfinite=policy)
        pipe.make_optimizer(torch.optim.SGD, lr=0.1, max_grad_norm=clip)
        args = [a.clone() for a in local_batch(pipe, spec.args)]
        pipe.train_step(*args, **local_batch(pipe, spec.kwargs))  # a good step first
        before = pipe.full_state_dict()
        if rank == 0:
            args[0][1, 2, 3] = float("nan")
        with w.catch_warnings(record=True) as caught:
            w.simplefilter("always")
            try:
                pipe.train_step(*args, **local_batch(pipe, spec.kwargs))
                raised = "no error"
            except Exception as e:  # noqa: BLE001
                raised = f"{type(e).__name__}: {e}"
        after = pipe.full_state_dict()
        out[policy] = {
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "finite": all(bool(torch.isfinite(v).all()) for v in after.values() if v.is_floating_point()),
            "raised": raised,
            "warned": [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)],
            "skipped": pipe.nonfinite.skipped,
        }
    # the caller's own optimizer after train_step, make_optimizer's stepped by the caller in the plain loop, and the
    # caller's own in the plain loop (torch's global step pre-hook: runtime/module.py _check_own_optimizer)
    for loop in ("own", "plain", "own plain"):
        pipe = autopar.compile(spec.model, mesh, args=spec.args, kwargs=spec.kwargs, batch="local")
        if loop == "plain":
            opt = pipe.make_optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        args = [a.clone() for a in local_batch(pipe, spec.args)]
        kwargs = local_batch(pipe, spec.kwargs)

        def step(args=args, kwargs=kwargs, loop=loop, pipe=pipe, opt=opt):
            if loop == "own":
                pipe.train_step(*args, **kwargs)
            else:
                pipe(*args, **kwargs).backward()
            opt.step()
            opt.zero_grad()

        step()  # a good step first
        before = pipe.full_state_dict()
        if rank == 0:
            args[0][1, 2, 3] = float("nan")
        with w.catch_warnings(record=True) as caught:
            w.simplefilter("always")
            step()
        after = pipe.full_state_dict()
        out[loop] = {
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "finite": all(bool(torch.isfinite(v).all()) for v in after.values() if v.is_floating_point()),
            "raised": "no error",
            "warned": [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)],
            "skipped": pipe.nonfinite.skipped,
        }
    out["flag reduces"] = len(flags)
    # when a rank's own look is not the world's: a gradient edited in place since its sum, one accumulated
    # without a sync (no_sync), a tp plan (the shards differ by rank); each then agrees by the flag's all-reduce
    pipe = autopar.compile(spec.model, mesh, args=spec.args, kwargs=spec.kwargs, batch="local")
    args, kwargs = local_batch(pipe, spec.args), local_batch(pipe, spec.kwargs)
    pipe(*args, **kwargs).backward()
    identical = [pipe._grads.world_identical()]
    next(iter(pipe.parameters())).grad.mul_(1.0)
    identical.append(pipe._grads.world_identical())
    pipe.zero_grad()
    pipe(*args, **kwargs).backward()
    with pipe.no_sync():
        pipe(*args, **kwargs).backward()
    identical.append(pipe._grads.world_identical())
    tp = autopar.compile(spec.model, autopar.init_mesh("cpu", tp=2), args=spec.args, kwargs=spec.kwargs)
    tp(*spec.args, **spec.kwargs).backward()
    out["identical"] = [*identical, tp._grads.world_identical()]
    nonfinite.guarded = counting
    return out


def test_the_gradient_check_finds_any_non_finite_element_with_one_read():
    """``NonFinite``'s local check (one fused max-norm pass, one host read): a NaN or inf anywhere, in fp32 or
    bf16, dense or sparse, is found; finite gradients, empty ones and none at all pass."""
    from autopar.runtime.grads.nonfinite import _all_finite

    finite = [torch.randn(5, 3), torch.empty(0), torch.ones(4, dtype=torch.bfloat16) * 3e38]
    assert _all_finite(finite) and _all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.zeros(7, 2, dtype=dtype)
            g[6, 1] = bad
            assert not _all_finite([*finite, g]), (bad, dtype)
    sparse = torch.sparse_coo_tensor([[0, 3]], torch.tensor([1.0, float("nan")]), (5,))
    assert not _all_finite([sparse]) and _all_finite([torch.sparse_coo_tensor([[1]], torch.tensor([2.0]), (5,))])


@pytest.mark.multiproc
def test_a_failure_on_one_rank_is_raised_on_every_rank():
    """Planning fails on rank 0 only (compile plans there and broadcasts): every rank raises the same
    ``SolverError`` (before: the others died of gloo's "Connection closed by peer" or waited in the broadcast).
    A label out of range in rank 0's local rows only: every rank raises the same ``InputRangeError`` before the
    step communicates, and the next good step trains on both (before: rank 0 raised, rank 1 entered the step's
    collectives alone). A NaN in rank 0's input rows: under on_nonfinite "warn_skip" (default), "skip" (with
    max_grad_norm: the norm is NaN) and "raise" no parameter changes on either rank (before: NaN everywhere).
    On pp=2, a stage of rank 1 raising while rank 1 lives on: rank 0 raises ``PeerFailedError`` naming rank 1
    and its error within seconds (before: ``RuntimeCommError`` after the 60 s transfer timeout).
    Cost: one spawn of two processes, four compiles of tiny-gpt2 (one refused), three of tiny-mlp."""
    from tests._dist import run_distributed

    results = run_distributed(_every_rank_told, 2, timeout=300)
    planning = [r["planning"] for r in results]
    assert all(p.startswith("SolverError: the ILP found no strategy (made to fail by") for p in planning), planning
    label = [r["label"] for r in results]
    assert all(x.startswith("InputRangeError: input 'labels': 1 labels outside [0, 128)") for x in label), label
    assert "found on rank 0" in label[1], label
    assert results[0]["after"] == results[1]["after"] and results[0]["after"] == results[0]["after"]  # finite, equal

    # a NaN in one rank's input rows: the step is never applied, on every rank alike
    for rank, r in enumerate(results):
        for policy in ("warn_skip", "skip", "raise"):
            assert r[policy]["unchanged"] and r[policy]["finite"], (rank, policy, r[policy])
        assert r["warn_skip"]["raised"] == "no error" and r["warn_skip"]["skipped"] == 1, r["warn_skip"]
        assert any("skipped on every rank" in m for m in r["warn_skip"]["warned"]), r["warn_skip"]
        assert r["skip"]["raised"] == "no error" and not r["skip"]["warned"] and r["skip"]["skipped"] == 1
        assert r["raise"]["raised"].startswith("NonFiniteError: some gradients are NaN"), r["raise"]
        for loop in ("own", "plain", "own plain"):  # the caller's optimizer after train_step or in the plain loop
            assert r[loop]["unchanged"] and r[loop]["finite"] and r[loop]["skipped"] == 1, (rank, loop, r[loop])
            assert any("skipped on every rank" in m for m in r[loop]["warned"]), (rank, loop, r[loop])
        # pure dp: the gradients are the same sums on both ranks, so the check asks no other rank (DDP has no such
        # collective); an in-place edit, a no_sync accumulation or a tp plan makes it agree by an all-reduce
        assert r["flag reduces"] == 0 and r["identical"] == [True, False, False, False], r

    # a member of a tp or dp group raising (alive after): rank 0, waiting in the collective, is told through the
    # store well within the group's timeout, naming the axis, the op and the member that did not arrive
    for axis in ("tp", "dp"):
        failed, survivor = results[1]["member_failed"][axis], results[0]["member_failed"][axis]
        assert failed["raised"].startswith(f"ValueError: injected: a bug in rank 1's step on {axis}"), failed
        told = (
            rf"PeerFailedError: rank 0: the (gradient )?all_reduce over mesh axis '{axis}' \(ranks \[0, 1\]\) cannot "
            r"complete: rank 1 did not arrive, rank 1 raised \(ValueError: injected"
        )
        assert re.match(told, survivor["raised"]), survivor
        assert survivor["seconds"] < PEER_TIMEOUT / 4, survivor  # polled every 0.2 s after 0.2 s; before: 60 s

    # a stage raising on pipeline rank 1 (alive after): rank 0 is told through the store, well within the timeout
    failed, survivor = results[1]["peer_failed"], results[0]["peer_failed"]
    assert failed["raised"].startswith("ValueError: injected"), failed
    assert survivor["raised"].startswith(
        "PeerFailedError: rank 0: rank 1 raised during this step (ValueError: injected: a bug in stage 1's backward)"
    ), survivor
    assert survivor["seconds"] < PEER_TIMEOUT / 4, survivor  # polled every 0.2 s; before: the 60 s timeout


# -- internal tracebacks turned into named errors ---------------------------------------------------------------


def _plan_dict() -> dict:
    return {
        "format": "autopar-plan", "version": 1, "fingerprint": "0" * 64, "mesh": {"dp": 1}, "program": "",
        "model": "tiny-mlp", "cluster": None, "options": {"setup": {}}, "config": None, "stats": {},
        "baselines": {}, "pipeline": None,
    }  # fmt: skip


def _edited_plan(tmp_path, **changes) -> str:
    data = _plan_dict() | changes
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


def _deep(tmp_path) -> str:
    path = tmp_path / "deep.json"
    path.write_text('{"format": ' + "[" * 100000 + "]" * 100000 + "}")
    return str(path)


def _load(path: str):
    from autopar.plan import Plan

    return Plan.load(path)


CHEAP_CASES = {  # name -> (what to run, given tmp_path; the error class; a part of its message)
    "deep plan JSON": (lambda t: _load(_deep(t)), "PlanError", "nests its JSON too deeply"),
    "plan mesh a list": (lambda t: _load(_edited_plan(t, mesh=["dp", 1])), "PlanError", "'mesh' must be an object"),
    "plan program an int": (lambda t: _load(_edited_plan(t, program=7)), "PlanError", "'program' must be a string"),
    "plan mesh size 0": (lambda t: _load(_edited_plan(t, mesh={"dp": 0})), "PlanError", "positive integers"),
    "unknown setup keys": (
        lambda t: _load(_edited_plan(t, options={"setup": {"zerro": 2}})),
        "PlanError",
        "unknown keys ['zerro']",
    ),
    "plan version '1'": (lambda t: _load(_edited_plan(t, version="1")), "PlanError", "a str, not the number 1"),
    "pipeline without stage_plan": (
        lambda t: _load(_edited_plan(t, pipeline={"pp": 2, "schedule": "1f1b"})),
        "PlanError",
        "lacks stage_plan",
    ),  # fmt: skip
    "n_layer=-2": (lambda t: _build("tiny-gpt2:n_layer=-2"), "PresetError", "must be a positive integer"),
    "NaN bandwidth": (lambda t: _cluster(intra_node_bandwidth=float("nan")), "ClusterSpecError", "finite number"),
    "simulate -P 100000 -M 100000000": (
        lambda t: _simulate_flags(),
        "ScheduleError",
        "at most 1,000,000 stage-microbatches",
    ),
}


def _build(spec: str):
    from autopar.models.resolve import build

    return build(spec, device="meta")


def _cluster(**changes):
    import dataclasses

    from autopar.solver.cluster.spec import ClusterSpec

    return dataclasses.replace(ClusterSpec.load("dgx-a100"), **changes)


def _simulate_flags():
    import argparse

    from autopar.cli import simulate

    parser = argparse.ArgumentParser()
    simulate.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", "-P", "100000", "-M", "100000000"])
    return simulate._from_flags(args)


@pytest.mark.parametrize("case", list(CHEAP_CASES))
def test_bad_input_gets_a_named_error_not_a_traceback(case, tmp_path):
    """Each case raised an internal error (RecursionError, AttributeError, TypeError, KeyError, a 0-layer model,
    a NaN priced as optimal, a refusal of version "1" as "reads version 1", a simulation growing without bound):
    now an AutoparError naming the problem. Cost: no model is compiled."""
    import autopar.errors as errors

    fn, cls, message = CHEAP_CASES[case]
    with pytest.raises(getattr(errors, cls)) as info:
        fn(tmp_path)
    assert message in str(info.value), str(info.value)


def test_float_ids_float_labels_and_a_missing_input_are_named_at_the_call():
    """On a compiled tiny-gpt2 (one process): float ``input_ids`` or float ``labels`` (once silently truncated)
    raise ``InputRangeError``; a missing or an extra input names them instead of dumping two TreeSpecs, an added
    ``attention_mask`` or a shorter sequence is refused. Cost: one compile of tiny-gpt2."""
    import autopar
    from autopar.errors import BatchError, CaptureError, InputRangeError
    from autopar.models.resolve import build

    spec = build("tiny-gpt2", device="cpu", seed=0)
    with _one_process():
        pipe = autopar.compile(spec.model, autopar.init_mesh("cpu", dp=1), kwargs=spec.kwargs)
        with pytest.raises(InputRangeError, match="'input_ids' holds token ids but is torch.float32"):
            pipe.train_step(**(spec.kwargs | {"input_ids": spec.kwargs["input_ids"].float()}))
        with pytest.raises(InputRangeError, match="'labels' holds labels but is torch.float32"):
            pipe.train_step(**(spec.kwargs | {"labels": spec.kwargs["labels"].float() + 0.5}))
        with pytest.raises(CaptureError, match=r"missing \['labels'\]"):
            pipe.train_step(input_ids=spec.kwargs["input_ids"])
        with pytest.raises(CaptureError, match=r"not compiled for \['mask'\]"):
            pipe.train_step(**spec.kwargs, mask=spec.kwargs["labels"])
        # captured without a mask, its SDPA is causal for these shapes (passes/hf_masks.py): a padding mask or
        # another sequence length is refused, never run with is_causal
        ids = spec.kwargs["input_ids"]
        for mask in (torch.ones_like(ids), None):
            with pytest.raises(CaptureError, match=r"not compiled for \['attention_mask'\]"):
                pipe.train_step(**spec.kwargs, attention_mask=mask)
        with pytest.raises(CaptureError, match=r"has shape \[4, 8\] but the model was compiled for \[4, 16\]"):
            pipe.train_step(input_ids=ids[:, :8], labels=ids[:, :8])
        assert "TreeSpec" not in _raised(lambda: pipe.train_step(input_ids=spec.kwargs["input_ids"]))
        # inputs on another device holding no data (meta): named, not "Tensor.item() cannot be called"
        for name in ("labels", "input_ids"):
            with pytest.raises(BatchError, match=f"input '{name}' is on the meta device"):
                pipe.train_step(**(spec.kwargs | {name: spec.kwargs[name].to("meta")}))
        pipe.train_step(**spec.kwargs)


def _raised(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return str(e)
    return ""


def test_a_stuck_store_host_is_named_as_the_likely_stuck_rank(monkeypatch):
    """When rank 0, which serves the job's store, is the stuck one, the survivors cannot agree who arrived (the
    store does not answer): their ``RuntimeCommError`` names rank 0 as the likely stuck rank. Here rank 1 of a
    two-rank world over a store that times out. Before: "could not be told", no rank named. Cost: no spawn."""
    from autopar.errors import RuntimeCommError
    from runtime.comm import watch

    class Silent:  # the store of a SIGSTOPped rank 0: every request times out
        def set_timeout(self, _):
            pass

        def set(self, *_):
            raise dist.DistStoreError("wait timeout after 1000ms, keys: autopar/arrived/0/1/1")

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: Silent())
    monkeypatch.setattr(dist, "get_rank", lambda *_: 1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(watch, "_ranks", lambda _: [0, 1])
    monkeypatch.setattr(watch, "_timeout_of", lambda _: 5.0)
    err = watch.failure(RuntimeError("[gloo] Timed out waiting 5000ms for recv"), object(), "pp", "recv", 1)
    assert isinstance(err, RuntimeCommError), err
    assert "rank 0 is likely the stuck one" in str(err) and "within 5s" in str(err), str(err)
