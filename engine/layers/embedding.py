"""The vocab-parallel token embedding (Megatron-LM, Shoeybi et al. 2019, section 3).

Rank ``r`` of ``tp`` holds rows ``r * V/tp .. (r+1) * V/tp`` of the ``[V, H]`` table; each rank
looks up the ids in its range (zeros for the others) and an all-reduce sums the ranks' rows,
so every rank ends with the full ``[T, H]`` embeddings. A tied LM head uses the same shard as
its vocab-parallel weight (``Qwen3ForCausalLM.compute_logits``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import _full, _split, default_weight_loader
from engine.layers.parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    """``[T]`` int64 ids -> ``[T, H]`` embeddings from a vocabulary split over the ranks.

    Args:
        num_embeddings: V, the full vocabulary; embedding_dim: H.
        tp: the tensor-parallel group (the all-reduce of the looked-up rows).

    Attributes:
        weight: ``[V/tp, H]``, this rank's rows; its ``weight_loader`` takes the ``[V, H]``
            checkpoint tensor and copies rows ``rank * V/tp ..``.

    Raises:
        ValueError: V not divisible by the tensor-parallel size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.per_rank = _split(num_embeddings, tp.size, "vocabulary size")
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader
        self.weight.shard_ids = (None,)
        self.weight.checkpoint_shapes = {None: (num_embeddings, embedding_dim)}

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        """This rank's rows of the ``[V, H]`` checkpoint tensor.

        Raises:
            ValueError: a checkpoint tensor without V rows.
        """
        full = _full(tensor, 0, self.num_embeddings)
        default_weight_loader(param, full.narrow(0, self.start, self.per_rank))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` int64 ``[T]`` -> ``[T, H]`` (the weight's dtype), the same on every rank."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"rows {self.start}..{self.start + self.per_rank} of {self.num_embeddings}, "
            f"dim {self.weight.shape[1]}"
        )
