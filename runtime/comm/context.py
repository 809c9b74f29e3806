"""A rank's communication context: each mesh axis's process group, coordinate and size, and its peers.

``Comm`` is what the collectives (``runtime/comm/collectives.py``) and a pipeline's point-to-point read;
``use_comm`` installs one around a compiled module's forward (a stack per thread: the rank simulator,
``runtime/sim/ranksim.py``, runs every simulated rank in its own thread).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.runtime.comm.teardown import holds_groups, shutdown_at_exit


class TorchPeers:
    """How a pipeline reaches its peers on torch.distributed: global ranks, point-to-point batches on the
    default group (as NCCL and gloo pair ranks), groups from ``new_group``. The rank simulator
    (``runtime/sim/ranksim.py``) gives its ranks its own ``SimPeers`` with the same methods."""

    @staticmethod
    def global_rank(group, member: int) -> int:
        """The global rank of ``group``'s member ``member``."""
        return dist.get_global_rank(group, member)

    @staticmethod
    def posts_independently() -> bool:
        """Whether each send and receive is its own op, so a receive may be posted before the list says:
        gloo's are; NCCL's batch is one group call on a stream that an early receive would hold up."""
        return dist.is_initialized() and dist.get_backend() == "gloo"

    @staticmethod
    def batch_isend_irecv(ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        """Post ``(is a send, tensor, peer's global rank)``. NCCL needs them as one
        ``torch.distributed.batch_isend_irecv`` (one group call, so paired ops cannot deadlock); gloo runs
        a batch op by op anyway, so there each is issued directly, without the coalescing manager's fixed
        cost per batch on every action's path."""
        if TorchPeers.posts_independently():
            return [(dist.isend if s else dist.irecv)(t, peer) for s, t, peer in ops]
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if s else dist.irecv, t, peer) for s, t, peer in ops])

    @staticmethod
    def new_group(ranks: list[int]):
        """A process group of ``ranks`` (global); every rank calls it for every group, in the same order."""
        return dist.new_group(ranks)


@dataclass
class Comm:
    """For each mesh axis name: its process group, this rank's coordinate and the axis size; ``peers``:
    point-to-point and new groups (torch.distributed's, or the rank simulator's)."""

    groups: dict[str, object]
    coords: dict[str, int]
    sizes: dict[str, int]
    peers: object = field(default_factory=TorchPeers)
    grad_dtype: torch.dtype | None = None  # gradient reductions' dtype (mixed precision's reduce_dtype)

    @property
    def rank(self) -> int:
        """This rank's place in the mesh, row-major (its global rank as ``init_device_mesh`` lays ranks out)."""
        rank = 0
        for name, n in self.sizes.items():
            rank = rank * n + self.coords[name]
        return rank

    @classmethod
    def from_device_mesh(cls, mesh) -> Comm:
        """The mesh's axes; the process's groups are then destroyed and freed at exit (runtime/comm/teardown.py)."""
        shutdown_at_exit()
        names = mesh.mesh_dim_names
        coords = mesh.get_coordinate()
        return cls(
            groups={n: mesh.get_group(n) for n in names},
            coords=dict(zip(names, coords)),
            sizes={n: mesh.size(i) for i, n in enumerate(names)},
        )


holds_groups(Comm, lambda comm: comm.groups.clear())

# Per thread: the rank simulator (runtime/sim/ranksim.py) runs every simulated rank in its own thread.
_LOCAL = threading.local()


def _stack() -> list[Comm]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


@contextlib.contextmanager
def use_comm(comm: Comm):
    _stack().append(comm)
    try:
        yield comm
    finally:
        _stack().pop()


def current_comm() -> Comm:
    if not _stack():
        raise RuntimeError("autopar collectives called outside a compiled module's forward")
    return _stack()[-1]


__all__ = ["Comm", "TorchPeers", "current_comm", "use_comm"]
