"""The process groups of one rank of a tensor-parallel engine (one process and device per rank).

Two groups over the same ranks, created by :func:`init_rank`:

* the device group, torch.distributed's default group: NCCL on CUDA (one communicator per
  rank, created eagerly on the rank's device), gloo on the CPU. The model's collectives run on
  it (all-reduces, the logits' gather, the sampled ids' broadcast), queued on the device
  stream and, on CUDA, captured in the CUDA graphs;
* the control group, gloo over TCP on every device type: rank 0 broadcasts each step's host
  inputs on it (``engine.worker.control_channel``), and start-up agrees on sizes through it.
  It is separate so that host messages never wait behind device work, and gloo reaches other
  hosts, which shared memory would not.

Ranks meet at ``init_method``: ``tcp://HOST:PORT`` (rank 0 hosts the rendezvous store; the
engine picks a free loopback port by default) or ``env://`` (torchrun's variables). The state
lives in a :class:`RankContext` handed to whoever needs it (no module-level state of ours;
torch.distributed keeps its default group per process).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.layers.parallel import TensorParallel

#: the device group's timeout: a collective that has not completed after this long fails (on
#: CUDA the NCCL watchdog then ends the process); steps take milliseconds, start-up collectives
#: wait for the slowest rank's weights and compilation
DEVICE_TIMEOUT = timedelta(minutes=15)
#: the control group's timeout: the other ranks wait for the next step as long as the engine is
#: idle, so it is long; a dead peer is seen at once anyway (its sockets close)
CONTROL_TIMEOUT = timedelta(days=30)


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of the rank with index ``local_rank`` on its host: ``cpu`` for every rank on
    the CPU; ``cuda:(N + local_rank)`` for ``device`` ``cuda:N`` (``cuda`` counts as
    ``cuda:0``).

    Raises:
        ValueError: a CUDA index beyond the visible devices.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    index = (dev.index or 0) + local_rank
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"rank with local index {local_rank} needs cuda:{index}, but {count} CUDA "
            f"device(s) are visible (--device {device})"
        )
    return torch.device("cuda", index)


def free_loopback_init_method() -> str:
    """``tcp://127.0.0.1:PORT`` with a port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def torchrun_rank(tp_size: int) -> tuple[int, int]:
    """(rank, local rank) of this process from torchrun's ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` (``env://``).

    Raises:
        ValueError: a variable missing, or ``WORLD_SIZE`` different from ``tp_size``.
    """
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise ValueError(
            "--distributed-init-method env:// needs RANK and WORLD_SIZE (and MASTER_ADDR, "
            "MASTER_PORT): start the ranks with torchrun"
        ) from None
    if world != tp_size:
        raise ValueError(
            f"torchrun started WORLD_SIZE={world} processes but --tensor-parallel-size is "
            f"{tp_size}; they must be equal (one process per rank)"
        )
    return rank, int(os.environ.get("LOCAL_RANK", rank))


def store_address(init_method: str) -> tuple[str, int]:
    """(host, port) of the rendezvous store of ``tcp://HOST:PORT`` or of ``env://``
    (``MASTER_ADDR``, ``MASTER_PORT``).

    Raises:
        ValueError: an address that cannot be read.
    """
    if init_method == "env://":
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    else:
        addr, _, port = init_method.removeprefix("tcp://").rpartition(":")
    if not addr or not port or not str(port).isdigit():
        raise ValueError(f"cannot read a store address from {init_method!r}")
    return addr.strip("[]"), int(port)


@dataclass
class RankContext:
    """One rank's place in the engine.

    Attributes:
        rank, size: this rank and the number of ranks (the tensor-parallel size).
        local_rank: index among the ranks of this host (picks the CUDA device).
        device: this rank's device; backend: the device group's ("nccl" or "gloo").
        tp: the model's collectives on the device group.
        control: the gloo group of host messages.
        init_method: where the ranks met.
    """

    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str
    tp: TensorParallel
    control: dist.ProcessGroup
    init_method: str

    def min_across_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank passes (every rank must call it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather_objects(self, obj) -> list | None:
        """Every rank's picklable ``obj``, in rank order, on rank 0 (None elsewhere); every
        rank must call it."""
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.control, 0), group=self.control)
        return out

    def close(self) -> None:
        """Leave the process groups (the process can start another engine afterwards)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def init_rank(
    device: str,
    rank: int,
    size: int,
    local_rank: int,
    init_method: str,
    timeout: timedelta = DEVICE_TIMEOUT,
) -> RankContext:
    """Join the engine's ranks: set this process's device, create the device group (NCCL on
    CUDA, eagerly bound to the device; gloo on the CPU) and the gloo control group.

    Args:
        device: the engine's ``--device`` ("cpu", "cuda", "cuda:N"); see :func:`rank_device`.
        rank, size, local_rank: this rank, the number of ranks, the index on this host.
        init_method: ``tcp://HOST:PORT`` or ``env://``.
        timeout: of the rendezvous and of the device group's collectives.

    Raises:
        ValueError: a bad device; RuntimeError / torch.distributed errors: the rendezvous
            failed or timed out.
    """
    dev = rank_device(device, local_rank)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timeout,
        device_id=dev if cuda else None,
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    tp = TensorParallel(rank, size, dist.group.WORLD)
    return RankContext(rank, size, local_rank, dev, backend, tp, control, init_method)
