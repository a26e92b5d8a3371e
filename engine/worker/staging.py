"""The worker's host <-> device copies: step arrays copied through reused pinned buffers, and
(:func:`copy_to_host_async`) step results copied back without waiting.

A copy from pageable memory makes the host wait for the device; a copy from pinned memory with
``non_blocking=True`` only queues it. The pinned buffer may not be refilled before the copy that
reads it has run, so each buffer's last copy is tracked with a CUDA event. Consecutive steps
alternate between two sets of buffers (:meth:`HostStaging.next_step`): with one step in flight,
the copy waited for belongs to the step before it, which has finished, so the host never waits
for the running step. Arrays of one dtype can travel together in one copy
(:meth:`HostStaging.stage_many`).
"""

from __future__ import annotations

import numpy as np
import torch


class HostStaging:
    """Pinned staging buffers of one device, by (name, parity, use within the step).

    A name staged twice in one step gets a second buffer, so a step never overwrites the source
    of its own queued copy. On a non-CUDA device arrays become tensors without a copy.

    Args:
        device: where the staged tensors go.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._events: dict[tuple, torch.cuda.Event] = {}
        self._uses: dict[str, int] = {}
        self._views: dict[tuple, tuple[torch.Tensor, np.ndarray]] = {}  # host_buffer's shapes
        self._parity = 0

    def next_step(self) -> None:
        """Switch to the other buffer set (call once at the start of every step)."""
        self._parity ^= 1
        self._uses.clear()

    def _buffer(
        self, name: str, numel: int, dtype: torch.dtype, zero: bool = False
    ) -> tuple[tuple, torch.Tensor]:
        use = self._uses.get(name, 0)
        self._uses[name] = use + 1
        key = (name, self._parity, use)
        pending = self._events.get(key)
        if pending is not None:
            pending.synchronize()
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            size = max(numel, 2 * (buf.numel() if buf is not None else 512))
            make = torch.zeros if zero else torch.empty
            buf = self._buffers[key] = make(size, dtype=dtype, pin_memory=self._cuda)
        return key, buf

    def host_buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[tuple, torch.Tensor, np.ndarray]:
        """A host buffer of ``shape`` for this step, to fill and then copy into a device tensor
        with :meth:`copy_into` (pinned on CUDA; zeros when first allocated, afterwards what
        this step's parity last wrote). It is safe to write: the copy that last read it has
        finished.

        Returns:
            ``(key, tensor, array)``: the key to pass to :meth:`copy_into`, the buffer, and a
            numpy view of it (made once, not per step).
        """
        shape = tuple(shape)
        numel = 1
        for n in shape:
            numel *= n
        key, buf = self._buffer(name, numel, dtype, zero=True)
        views = self._views.get(key)
        if views is None or views[0].data_ptr() != buf.data_ptr() or views[0].shape != shape:
            tensor = buf[:numel].view(shape)
            views = self._views[key] = (tensor, tensor.numpy())
        return key, views[0], views[1]

    def copy_into(self, key: tuple, host: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue ``dst.copy_(host)`` (a view of :meth:`host_buffer`'s buffer ``key`` into a
        device tensor of its shape and dtype; no host sync on CUDA)."""
        if not self._cuda:
            dst.copy_(host)
            return
        dst.copy_(host, non_blocking=True)
        self._record(key)

    def _copy(self, key: tuple, staged: torch.Tensor) -> torch.Tensor:
        out = staged.to(self.device, non_blocking=True)
        self._record(key)
        return out

    def _record(self, key: tuple) -> None:
        """Mark the end of the copy just queued from buffer ``key`` (one event per buffer,
        re-recorded: :meth:`_buffer` waited for its previous record already)."""
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = torch.cuda.Event()
        event.record()

    def stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """``array`` as a tensor on the device (same dtype and shape); the copy is queued."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        if not self._cuda:
            return t.to(self.device)
        key, buf = self._buffer(name, t.numel(), t.dtype)
        staged = buf[: t.numel()].view(t.shape)
        staged.numpy()[...] = t.numpy()  # numpy's copy: no torch intra-op thread pool
        return self._copy(key, staged)

    def stage_many(self, name: str, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Arrays of one dtype in one copy: device tensors (views of one buffer), same shapes;
        each view starts on a 16-byte boundary (see :func:`pack_offsets`).

        Raises:
            ValueError: arrays of different dtypes.
        """
        dtype = arrays[0].dtype
        if any(a.dtype != dtype for a in arrays):
            raise ValueError(f"stage_many needs one dtype, got {[a.dtype for a in arrays]}")
        sizes = [a.size for a in arrays]
        offsets, total = pack_offsets(sizes, dtype.itemsize)
        torch_dtype = _TORCH_DTYPES.get(dtype) or torch.from_numpy(arrays[0][:0]).dtype
        if self._cuda:
            key, buf = self._buffer(name, total, torch_dtype)
            host = buf[:total]
        else:
            host = torch.empty(total, dtype=torch_dtype)
        flat = host.numpy()
        for a, off in zip(arrays, offsets):
            flat[off : off + a.size] = a.reshape(-1)
        dev = self._copy(key, host) if self._cuda else host.to(self.device)
        # one split into the arrays and the alignment gaps after them (not a slice and a view
        # per array: each torch call costs microseconds of host time)
        ends = offsets[1:] + [total]
        pieces = []
        for n, off, end in zip(sizes, offsets, ends):
            pieces += (n, end - off - n)
        parts = dev.split_with_sizes(pieces)
        return [t if a.ndim == 1 else t.view(a.shape) for t, a in zip(parts[::2], arrays)]


#: numpy dtype -> torch dtype of the arrays the worker stages (others: via torch.from_numpy)
_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}


#: alignment of each array packed by :meth:`HostStaging.stage_many`, bytes (Triton specialises
#: pointer arguments on 16-byte alignment: unaligned views would compile extra kernel variants)
PACK_ALIGN_BYTES = 16


def pack_offsets(sizes: list[int], itemsize: int) -> tuple[list[int], int]:
    """Element offsets of arrays of ``sizes`` elements packed into one buffer with each start
    on a :data:`PACK_ALIGN_BYTES` boundary, and the buffer's length (at least 1)."""
    step = max(1, PACK_ALIGN_BYTES // itemsize)
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // step) * step
    return offsets, max(pos, 1)


def copy_to_host_async(
    tensors: tuple[torch.Tensor | None, ...],
) -> tuple[tuple[torch.Tensor | None, ...], torch.cuda.Event]:
    """Queue non-blocking copies of CUDA ``tensors`` into fresh pinned host tensors, and a CUDA
    event recorded after them on the current stream (wait on it before reading the copies).

    Args:
        tensors: CUDA tensors of any shape and dtype; None entries stay None.

    Returns:
        ``(host tensors in the same order, the event)``. Raises nothing of its own.
    """
    host: list[torch.Tensor | None] = []
    for t in tensors:
        if t is None:
            host.append(None)
            continue
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        host.append(h)
    event = torch.cuda.Event()
    event.record()
    return tuple(host), event
