"""Every error autopar raises on bad input: each names what is wrong and what to do about it."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of autopar's user-facing errors."""


class CaptureError(AutoparError):
    """torch.export could not capture the model, or the example inputs do not fit it."""


class BatchError(CaptureError):
    """A batch that does not fit the plan: its size, or an input a rank's stages read is missing."""


class OptimizerError(AutoparError):
    """Parameter groups that do not name the model's parameters, or gradients clipped out of order."""


class IRError(AutoparError):
    """The IR is malformed: a parse error or a verifier failure."""


class ParseError(IRError):
    """Text that is not valid autopar IR."""


class VerifyError(IRError):
    """An IR that breaks an invariant (SSA, shapes, placements)."""


class MeshError(AutoparError):
    """A mesh description that is malformed or does not fit the world size."""


class PresetError(AutoparError):
    """An unknown model preset, an unknown override key, or a MODEL spec that cannot be loaded."""


class SolverError(AutoparError):
    """The strategy ILP has no solution or the solver failed."""


class InfeasibleError(SolverError):
    """No strategy fits the memory budget."""

    def __init__(self, message: str, smallest_budget_bytes: float | None = None):
        super().__init__(message)
        self.smallest_budget_bytes = smallest_budget_bytes


class BaselineUnavailableError(InfeasibleError):
    """A baseline strategy whose fixed layout cannot exist on the mesh (e.g. a batch of 2 split over 4
    data-parallel devices); ``reason`` says which dim does not divide, in the user's terms."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class ClusterSpecError(AutoparError):
    """A cluster spec with a missing or malformed field."""


class PlanError(AutoparError):
    """A plan file that is malformed, of another version, or made for another graph or mesh."""


class PlacementError(PlanError):
    """A plan's program whose placements do not fit its ops on one rank (an edited placement): an op's local
    shards cannot be computed with, or give other shapes than its result's placements say."""


class ScheduleError(AutoparError):
    """A pipeline schedule that is malformed, deadlocks, or has unmatched sends and receives."""


class PipelineError(AutoparError):
    """The graph cannot be split into the requested pipeline stages."""


class RuntimeCommError(AutoparError):
    """A collective or point-to-point transfer failed or timed out (e.g. a peer rank died)."""


class PeerFailedError(RuntimeCommError):
    """Another rank raised during the step (published in the job's store): this rank stops waiting for it.
    ``rank`` and ``error`` name that rank and what it raised."""

    def __init__(self, message: str, rank: int = -1, error: str = ""):
        super().__init__(message)
        self.rank, self.error = rank, error


class SubPipelineError(PipelineError):
    """Sub-pipelined tensor parallelism asked for where it cannot run (an odd microbatch, no tensor-parallel
    collective to overlap)."""


class TooFewSubgraphsError(PipelineError):
    """More pipeline stages were asked for than the graph has subgraphs."""

    def __init__(self, message: str, num_subgraphs: int):
        super().__init__(message)
        self.num_subgraphs = num_subgraphs


class NoLegalCutError(PipelineError):
    """The graph has no gap that few enough tensors cross: it is one subgraph."""


class StageMemoryError(PipelineError):
    """No partition of the subgraphs into the requested stages fits the per-device memory budget."""

    def __init__(self, message: str, smallest_budget_bytes: float | None = None, smallest_pp: int | None = None):
        super().__init__(message)
        self.smallest_budget_bytes = smallest_budget_bytes
        self.smallest_pp = smallest_pp


class SimulationError(AutoparError):
    """The single-process rank simulator found ranks that disagree: different collectives, a deadlock,
    or a rank that failed."""


class CheckError(AutoparError):
    """``autopar check`` found the sharded program computing something else than the model."""


class CheckpointError(AutoparError):
    """A checkpoint that cannot be saved or loaded as asked."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of another model: keys missing or of another shape than this model's."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint whose save never committed (interrupted), or one of whose files is missing."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file whose size or checksum differs from what the save recorded (truncated, overwritten)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holding pickled objects, whose loading could run code: autopar never writes such."""


class ConfigError(AutoparError):
    """A TrainConfig field, a config file or a compile() keyword that autopar cannot use."""


class PrecisionError(AutoparError):
    """A mixed-precision policy autopar cannot run (an unknown dtype, a plan's precision it cannot apply)."""


class BatchCouplingError(BatchError):
    """A model whose loss couples its batch (contrastive logits over the batch, batch-level statistics, batch
    norm) run as several microbatches, which would train another model (``passes/batch_coupling.py``)."""


class UnsupportedOpError(CaptureError):
    """An op of the model that the ranks' generated code could not call: its name resolves to no registered torch
    op (e.g. a custom op whose library is not imported, or a name that lost its namespace)."""


class NotOptimalPlanWarning(UserWarning):
    """The strategy ILP hit its time limit: the plan is valid (the solver's best, or autopar's own feasible one)
    but not proven optimal; the message gives its status and gap and what to do."""


class PipelineBackwardError(PipelineError):
    """A backward through the outputs of a pipelined module's call: on a pp mesh only ``train_step`` trains."""


class MetricsWriterError(AutoparError):
    """A metrics writer (TensorBoard, W&B) whose package is not installed."""


class SearchError(AutoparError):
    """A whole-plan search result asked for what the search did not keep (more plans than its ``top``)."""


class InputRangeError(BatchError, IndexError):
    """A token id or a class label outside the table or the classes it indexes (what eager raises as an
    ``IndexError``; also one, so code catching that still does)."""


class NonFiniteError(AutoparError):
    """A training step whose loss or gradients are NaN or infinite, with ``on_nonfinite="raise"``."""
