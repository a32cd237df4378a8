"""Which process of a ``torchrun`` launch this is, and the few collectives a sharded index build needs.

Interface: ``join_shard_group(requested)`` is a context manager yielding a ``ShardGroup`` when the
process was started by ``torchrun`` (``WORLD_SIZE`` above 1, with ``RANK`` and ``LOCAL_RANK``), or
``None`` for a plain single process; ``requested`` is the ``--distributed/--no-distributed`` flag
(``None``: follow the environment). ``shard_device(device, group)`` is the device a rank computes
on: ``cuda:LOCAL_RANK`` when CUDA is visible and the config says ``auto`` or ``cuda`` (one process
per GPU: a LOCAL_RANK without a GPU of its own is refused).

The process group is initialized here only when nobody initialized one before (backend ``nccl``
on CUDA, ``gloo`` on CPU, rendezvous from ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets them),
and destroyed on leaving the context only in that case (or earlier, by ``ShardGroup.leave()``, where
every rank leaves together once the sharded work is done and rank 0 goes on alone).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from gradian.errors import ConfigError, GradianEnvironmentError

__all__ = ["ShardGroup", "join_shard_group", "shard_device", "torchrun_world"]

#: the variables torchrun sets in every process it starts
_WORLD_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


@dataclass
class ShardGroup:
    """This process's place in a torch.distributed group: ``rank`` of ``world_size``."""

    rank: int
    world_size: int
    #: the rank on this node; picks the GPU
    local_rank: int
    #: ``nccl`` or ``gloo``
    backend: str
    #: this process initialized the process group (and destroys it on leaving)
    owned: bool = False
    #: ``leave`` was called: the group is no more, each process works alone from here
    left: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that holds the build lock, commits the manifest and reports."""
        return self.rank == 0

    def broadcast(self, value: object = None) -> Any:
        """Rank 0's ``value`` on every rank (the others pass nothing): whatever rank 0 sent."""
        import torch.distributed as dist

        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: object) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank: whatever each rank sent."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def leave(self) -> None:
        """Every rank leaves the group here together, after its last collective: one barrier, then
        the group is destroyed (where this process initialized it). Rank 0 can then go on alone
        for as long as it needs, with no other rank waiting in a collective that could time out."""
        import torch.distributed as dist

        if self.left:
            return
        self.left = True
        if dist.is_initialized():
            dist.barrier()
            if self.owned:
                dist.destroy_process_group()


def torchrun_world() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from torchrun's environment, or ``None`` when it is unset."""
    raw = {name: os.environ.get(name) for name in _WORLD_VARIABLES}
    if raw["WORLD_SIZE"] is None:
        return None
    values = {}
    for name, text in raw.items():
        try:
            values[name] = int(text if text is not None else "")
        except ValueError:
            raise ConfigError(
                f"environment variable {name}={text!r} is not an integer; WORLD_SIZE, RANK and LOCAL_RANK "
                "are set by torchrun: launch with `torchrun --nproc-per-node N -m gradian ...` or unset them"
            ) from None
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ConfigError(f"environment WORLD_SIZE={world} RANK={rank} LOCAL_RANK={local} is not a valid "
                          "torchrun placement (0 <= RANK < WORLD_SIZE); launch through torchrun")
    return rank, world, local


@contextmanager
def join_shard_group(requested: bool | None = None) -> Iterator[ShardGroup | None]:
    """Join (initializing it when needed) the process group torchrun set up; ``None`` when single.

    ``requested`` False ignores the environment (every process works alone); True refuses to run
    without torchrun's environment; None shards exactly when ``WORLD_SIZE`` is above 1.
    """
    world = None if requested is False else torchrun_world()
    if world is None:
        if requested:
            raise ConfigError(
                "--distributed: this process was not started by torchrun (WORLD_SIZE, RANK and LOCAL_RANK "
                "are unset); launch with `torchrun --nproc-per-node N -m gradian ...`, or drop --distributed"
            )
        yield None
        return
    rank, world_size, local_rank = world
    if world_size == 1:
        yield None
        return
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise GradianEnvironmentError("this torch build has no torch.distributed; run without torchrun "
                                      "or install a torch with distributed support")
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(_local_gpu(local_rank))
    owned = not dist.is_initialized()
    if owned:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ConfigError(f"WORLD_SIZE={world_size} but {' and '.join(missing)} unset: the processes cannot "
                              "find each other; launch through torchrun, which sets them")
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    else:
        backend = str(dist.get_backend())
    try:
        group = ShardGroup(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, owned=owned)
        yield group
    except BaseException:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
        raise
    if owned and not group.left and dist.is_initialized():
        # every rank reaches the teardown before any tears down: a rank that leaves first closes
        # its gloo pairs (and rank 0 the rendezvous store) under a peer still using them, which
        # can abort that peer at exit ("terminate called without an active exception"); a rank
        # that failed is not waited for, torchrun stops the others
        dist.barrier()
        dist.destroy_process_group()


def shard_device(device: str, group: ShardGroup | None) -> str:
    """The device a rank computes on: ``cuda:LOCAL_RANK`` for ``auto``/``cuda`` when CUDA is visible
    (``auto`` is ``cpu`` otherwise); an explicit ``cpu``, ``mps`` or ``cuda:N`` is kept."""
    if group is None or device not in ("auto", "cuda"):
        return device
    import torch

    if torch.cuda.is_available():
        return f"cuda:{_local_gpu(group.local_rank)}"
    return "cpu" if device == "auto" else device


def _local_gpu(local_rank: int) -> int:
    """The GPU of ``local_rank``: its own, one process per GPU (NCCL refuses two ranks on one)."""
    import torch

    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"LOCAL_RANK={local_rank} but this process sees {count} CUDA device(s): start at most "
                          f"{count} processes per node (torchrun --nproc-per-node {count})")
    return local_rank
