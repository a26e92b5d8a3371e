"""Where an engine's model lives: one :class:`RankLayout` per tensor-parallel rank (pure Python,
picklable, so it crosses the engine-core pipe to the server's start-up log and metrics)."""

from __future__ import annotations

from dataclasses import dataclass

_GIB = float(1 << 30)


@dataclass(frozen=True)
class RankLayout:
    """One rank of the engine (a single-device engine has one, rank 0).

    Attributes:
        rank: tensor-parallel rank (0 runs the scheduler and the sampler).
        device: its torch device ("cuda:1", "cpu").
        host: host name; pid: process id.
        weight_bytes: bytes of the model parameters this rank holds (its shards).
        kv_cache_bytes: bytes of its KV cache (its KV heads of every block, keys and values).
        kv_heads: KV heads per layer in its cache.
    """

    rank: int
    device: str
    host: str
    pid: int
    weight_bytes: int
    kv_cache_bytes: int
    kv_heads: int

    def describe(self) -> str:
        """``rank 1: cuda:1 on host (pid 12), weights 7.63 GiB, KV cache 20.00 GiB (4 heads)``."""
        return (
            f"rank {self.rank}: {self.device} on {self.host} (pid {self.pid}), weights "
            f"{self.weight_bytes / _GIB:.2f} GiB, KV cache {self.kv_cache_bytes / _GIB:.2f} GiB "
            f"({self.kv_heads} KV heads per layer)"
        )


def describe_layout(ranks: tuple[RankLayout, ...]) -> str:
    """One line for the start-up log: the tensor-parallel size and every rank's placement."""
    return f"tensor parallel size {len(ranks)}; " + "; ".join(r.describe() for r in ranks)
