"""L2 prefetch of a small decode step's projection weights, a few projections ahead, on a side
stream of the step's CUDA graph (issue 19: the batch-1 step reads ~1.2 GB of weights at a
fifth of the HBM bandwidth because each GEMV starts its own fetch).

The model lists its weight-reading points in launch order (per dense decoder layer: q/k/v,
attention + o, gate/up, down; :class:`WeightPrefetch` is given the modules whose parameters
each point reads). At point ``j`` the side stream waits for the main stream's work so far and
launches :func:`kernels.l2_prefetch.l2_prefetch` for the weights of point ``j + distance``; the
GEMV of that point finds them in L2 (the H200's is 50 MB; one layer of Qwen3-0.6B is 31 MB, so
the distance is kept to one or two projections, and a point of more than a third of L2 is not
prefetched). Results do not change: the prefetch reads nothing into registers and writes
nothing.

Used only while a CUDA graph of a step of at most :data:`kernels.gemv.GEMV_MAX_M` tokens is
captured (decode steps of up to 16 sequences and the 16-token prefill graph: weight-bound
steps; larger ones reuse each weight tile across many rows; FP8's GEMV takes up to 32 rows,
but the same bound is kept for both), outside
``torch.compile`` tracing, and when ``QWEN_SERVE_L2_PREFETCH`` is on
(:mod:`engine.layers.kernel_switches`; the distance from ``QWEN_SERVE_L2_PREFETCH_DISTANCE``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.layers import kernel_switches

# kernels.gemv and kernels.l2_prefetch import Triton: imported where a CUDA step needs them (a
# CPU server imports no Triton; tests/unit/test_import_layers.py)

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One prefetch stream per CUDA device, made on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


#: a point is prefetched only if its bytes are at most this share of the device's L2: larger
#: weights (Qwen3-8B's projections, 33-100 MB) would evict the points before them
MAX_L2_SHARE = 1 / 3


def point_tensors(modules: Sequence[nn.Module], max_bytes: int | None = None) -> list[torch.Tensor]:
    """The tensors a point reads: each module's own parameters and buffers (weight, bias, FP8
    scales), contiguous ones only, at most :data:`kernels.l2_prefetch.MAX_RANGES` of them,
    largest first (a point's weights beyond that are left to the GEMV's own fetch); none when
    they sum to more than ``max_bytes`` (None: no bound)."""
    from kernels.l2_prefetch import MAX_RANGES

    tensors = [
        t
        for m in modules
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if t.is_contiguous() and t.numel() > 0
    ]
    tensors.sort(key=lambda t: t.numel() * t.element_size(), reverse=True)
    tensors = tensors[:MAX_RANGES]
    if max_bytes is not None and sum(t.numel() * t.element_size() for t in tensors) > max_bytes:
        return []
    return tensors


class PrefetchSchedule:
    """Which points' weights to ask for when: at point ``j`` every point up to ``j + distance``
    not asked for yet (so the first call also asks for the points before it), each once.

    Args:
        num_points: points in the step; distance: how many points ahead (>= 1).

    Raises:
        ValueError: ``distance < 1``.
    """

    def __init__(self, num_points: int, distance: int):
        if distance < 1:
            raise ValueError(f"prefetch distance must be >= 1, got {distance}")
        self.num_points = num_points
        self.distance = distance
        self.next = 0  # the first point whose weights are not asked for yet

    def due(self, point: int) -> range:
        """The points to ask for now, before point ``point``'s kernels launch (marked asked)."""
        last = min(point + self.distance, self.num_points - 1)
        due = range(self.next, max(self.next, last + 1))
        self.next = due.stop
        return due


class WeightPrefetch:
    """One step's L2 prefetch over ``points`` (each a list of modules, in the order the step's
    kernels read them), launched on the device's side stream after the main stream's work so
    far (:class:`PrefetchSchedule` says which points when).

    Args:
        points: per weight-reading point, the modules whose parameters it reads.
        distance: how many points ahead to prefetch (>= 1).

    Call :meth:`at` before the kernels of each point, in order, then :meth:`finish` before the
    step's output is used (joins the side stream into the current stream, as CUDA-graph capture
    requires). Built while the step's current (capturing) stream is current.
    """

    def __init__(self, points: Sequence[Sequence[nn.Module]], distance: int):
        self._main = torch.cuda.current_stream()
        self._side = _side_stream(self._main.device)
        l2 = torch.cuda.get_device_properties(self._main.device).L2_cache_size
        self.points = [point_tensors(p, int(l2 * MAX_L2_SHARE)) for p in points]
        self.schedule = PrefetchSchedule(len(self.points), distance)

    def at(self, point: int) -> None:
        """The main stream is about to launch point ``point``'s kernels."""
        due = self.schedule.due(point)
        if not due:
            return
        from kernels.l2_prefetch import l2_prefetch

        self._side.wait_stream(self._main)
        with torch.cuda.stream(self._side):
            for j in due:
                if self.points[j]:
                    l2_prefetch(self.points[j])

    def finish(self) -> None:
        """Join the side stream into the main stream (the step's last kernels wait for the
        prefetch launches, which are short)."""
        if self.schedule.next > 0:
            self._main.wait_stream(self._side)


def prefetch_distance(x: torch.Tensor) -> int | None:
    """How many points ahead this step prefetches, or None where it does not apply: the
    ``QWEN_SERVE_L2_PREFETCH`` switch is off, ``x`` (``[T, hidden]``, the step's embeddings) is
    not on CUDA, ``T > GEMV_MAX_M``, ``torch.compile`` is tracing, or no CUDA graph is being
    captured -- in which last case (the warm-up run before each capture) the kernel is
    compiled and loaded (:func:`kernels.l2_prefetch.warm_up`), which capture does not allow.
    Host-side only."""
    if not kernel_switches.L2_PREFETCH:
        return None
    from kernels.gemv import GEMV_MAX_M
    from kernels.l2_prefetch import warm_up

    if torch.compiler.is_compiling() or not x.is_cuda or x.shape[0] > GEMV_MAX_M:
        return None
    if not torch.cuda.is_current_stream_capturing():
        warm_up(x.device)
        return None
    return kernel_switches.L2_PREFETCH_DISTANCE
