"""The collectives a tensor-parallel model calls, bound to one process group.

Megatron-LM's tensor parallelism (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism"): a column-parallel layer followed by a
row-parallel one needs one all-reduce of the partial outputs (after o_proj, after down_proj or
the experts), the vocab-parallel embedding one all-reduce of the rows each rank looked up, and
the vocab-parallel LM head one gather of the logits' columns for the sampler.

A :class:`TensorParallel` is built by the worker (``engine.worker.parallel_state``) and handed
to the model at construction: layers never look a process group up in global state. A model
built without one (``tp=None``) is the single-device model and calls no collective.

On CUDA the group is NCCL and every collective is queued on the current stream without a host
sync (so it is captured in CUDA graphs: PyTorch >= 2.1 keeps captured NCCL work away from its
watchdog); on the CPU it is gloo and each call returns when done.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: all-gather into one tensor (``all_gather_single`` from PyTorch 2.13, which deprecates the
#: older name)
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallel:
    """This rank's place in its tensor-parallel group.

    Args:
        rank: this rank's index in the group (0 samples); size: ranks in the group.
        group: the device process group (NCCL on CUDA, gloo on CPU) the collectives run on.

    Raises:
        ValueError: a rank outside ``[0, size)``.
    """

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside [0, {size})")
        self.rank, self.size, self.group = rank, size, group
        self._first = dist.get_global_rank(group, 0)  # the global rank of group rank 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (any shape and float dtype); returns ``x``."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """The ranks' column blocks side by side, on rank 0.

        Args:
            x: ``[N, C]``, this rank's columns ``rank * C .. (rank + 1) * C`` (a vocab shard of
                the logits).

        Returns:
            On rank 0 a new ``[N, size * C]`` tensor (x's dtype); None on the other ranks (they
            take part in the collective, an all-gather, whose result only rank 0 reads).
        """
        n, c = x.shape
        out = torch.empty((self.size * n, c), dtype=x.dtype, device=x.device)
        _all_gather_tensor(out, x.contiguous(), group=self.group)
        if self.rank:
            return None
        return out.view(self.size, n, c).permute(1, 0, 2).reshape(n, self.size * c)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (the other ranks pass a buffer of the same
        shape and dtype); returns ``x``."""
        dist.broadcast(x, src=self._first, group=self.group)
        return x

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"
