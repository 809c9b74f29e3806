"""Offline strategy generation for a target cluster: search mesh, schedule, micro-batch, ZeRO and recomputation.

One module per step (see ``search.py`` for how a search runs):

    profile.py       profile a model: per-layer costs read from its IR (cached by model spec)
    space.py         the candidates: meshes, micro-batches, schedules, recomputation, ZeRO / MiCS
    price.py         the analytic price of a candidate (stage_layout.py, comm_time.py)
    score.py         simulation scoring of the priced candidates
    search.py        the branch-and-bound search and its entry points (search, search_model)
    result.py        the K best plans as a table or JSON
    materialize.py   a chosen candidate -> a Plan (and a Plan -> its launch options)
    cli.py           ``autopar plan MODEL --cluster SPEC --global-batch B``

``autopar.search.search`` is the function; the module is ``autopar.search.search`` only through
``sys.modules`` (``from autopar.search.search import search_model`` works, ``import ... as`` does not).
"""

from __future__ import annotations

from autopar.search.cli import run_cli
from autopar.search.evaluation import Evaluation
from autopar.search.materialize import build_plan, launch_options
from autopar.search.price import Analytic
from autopar.search.profile import Profile, UnitCost, profile_model, profile_program, with_batch
from autopar.search.result import SearchResult
from autopar.search.score import FULL_SIMULATION, Scorer
from autopar.search.search import search, search_model
from autopar.search.space import Candidate, SearchSpace

__all__ = [
    "FULL_SIMULATION",
    "Analytic",
    "Candidate",
    "Evaluation",
    "Profile",
    "Scorer",
    "SearchResult",
    "SearchSpace",
    "UnitCost",
    "build_plan",
    "launch_options",
    "profile_model",
    "profile_program",
    "run_cli",
    "search",
    "search_model",
    "with_batch",
]
