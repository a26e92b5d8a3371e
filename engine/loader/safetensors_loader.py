"""Load Hugging Face safetensors checkpoints (or the GGUF file a prepared GGUF model directory
names, see :mod:`engine.loader.gguf_loader`) into an engine model through its parameters'
weight loaders (fused q/k/v and gate/up shards, tensor-parallel slices).

Each safetensors tensor reaches the weight loaders as a :class:`CheckpointSlice`, a lazy window
of the file: the loaders narrow it to the rank's part and only that part is read (safetensors'
``get_slice``), so a tensor-parallel rank never reads, nor holds in host or device memory, the
other ranks' shards; on one device the window is the whole tensor, read once. A GGUF tensor is
dequantized whole (gguf-py has no partial reads) and reaches the same loaders as a float32
``torch.Tensor``, which they slice in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.layers.linear import default_weight_loader

#: safetensors header dtype names -> torch dtypes
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    _SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class CheckpointSlice:
    """A window of one tensor of an open safetensors file, read when materialised.

    Quacks like the part of ``torch.Tensor`` the weight loaders use: ``shape``, ``dtype``,
    ``element_size()``, ``is_floating_point()``, ``dim()``,
    ``narrow(dim, start, length)``, ``select(dim, index)``, indexing/iterating along dim 0
    (stacked expert tensors); :meth:`materialize` reads the window.

    Args:
        handle: ``safe_open(...).get_slice(name)``; shape: the file tensor's shape (unused when
            ``window`` is given).
        window: per file dim, ``(start, stop)`` or an int (a selected, dropped dim); None: all.
    """

    def __init__(self, handle, shape, window: tuple | None = None):
        self._handle = handle
        self._window = window if window is not None else tuple((0, n) for n in shape)

    @property
    def dtype(self) -> torch.dtype:
        """The file tensor's dtype: from its header, or (a name this table lacks) from reading
        one element."""
        dtype = _SAFETENSORS_DTYPES.get(self._handle.get_dtype())
        if dtype is None:
            shape = self._handle.get_shape()
            dtype = self._handle[tuple(slice(0, min(1, n)) for n in shape)].dtype
        return dtype

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def shape(self) -> torch.Size:
        return torch.Size(w[1] - w[0] for w in self._window if not isinstance(w, int))

    def dim(self) -> int:
        return len(self.shape)

    def _file_dim(self, dim: int) -> int:
        """Index in the window of the ``dim``-th kept dimension."""
        kept = [i for i, w in enumerate(self._window) if not isinstance(w, int)]
        return kept[dim]

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        """Rows ``start .. start + length`` along ``dim``.

        Raises:
            ValueError: a range outside the window.
        """
        i = self._file_dim(dim)
        a, b = self._window[i]
        if start < 0 or length < 0 or a + start + length > b:
            raise ValueError(f"narrow({dim}, {start}, {length}) outside shape {tuple(self.shape)}")
        window = list(self._window)
        window[i] = (a + start, a + start + length)
        return CheckpointSlice(self._handle, None, tuple(window))

    def select(self, dim: int, index: int) -> CheckpointSlice:
        """Index ``index`` along ``dim``, which is dropped (as ``Tensor.select``)."""
        i = self._file_dim(dim)
        a, b = self._window[i]
        if not 0 <= index < b - a:
            raise IndexError(f"index {index} out of range for dim {dim} of {tuple(self.shape)}")
        window = list(self._window)
        window[i] = a + index
        return CheckpointSlice(self._handle, None, tuple(window))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, int):
            return self.select(0, key)
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(len(self))
            return self.narrow(0, start, max(0, stop - start))
        raise TypeError(f"CheckpointSlice supports an int or a unit-step slice, got {key!r}")

    def __iter__(self):
        return (self.select(0, i) for i in range(len(self)))

    def materialize(self) -> torch.Tensor:
        """The window as a CPU tensor in the file's dtype (only its bytes are read)."""
        index = tuple(w if isinstance(w, int) else slice(*w) for w in self._window)
        return self._handle[index]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` or the shards its index lists.

    Raises:
        FileNotFoundError: neither a single file nor an index is present.
    """
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / s for s in shards]
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {d}")
    return files


def checkpoint_tensors(
    model_dir: str | Path,
) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """(Hugging Face name, tensor) of every checkpoint tensor, one at a time: from the GGUF file
    that the directory's config.json names in ``"gguf_file"`` (a ``torch.Tensor`` dequantized
    to float32, see :func:`engine.loader.gguf_loader.gguf_tensors`), else from its safetensors
    files (a lazy :class:`CheckpointSlice` of the whole tensor, read in the stored dtype on the
    CPU when a loader materialises its part; valid while the iteration is at that tensor).

    Raises:
        FileNotFoundError: no weights. ValueError: a GGUF tensor type that cannot be dequantized,
            or a GGUF tensor with no Hugging Face counterpart.
    """
    from engine.loader.gguf_loader import gguf_file_of, gguf_tensors

    gguf_file = gguf_file_of(model_dir)
    if gguf_file is not None:
        yield from gguf_tensors(gguf_file)
        return
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                handle = f.get_slice(name)
                yield name, CheckpointSlice(handle, handle.get_shape())


def parameter_target(model: nn.Module, name: str) -> tuple[str, object]:
    """(parameter name, shard id) a checkpoint tensor loads into, through the model's
    ``packed_modules_mapping`` (fragment -> (fused fragment, shard id)); shard None if unfused."""
    for frag, (fused, shard) in model.packed_modules_mapping.items():
        if f".{frag}." in name:
            return name.replace(f".{frag}.", f".{fused}."), shard
    return name, None


def checkpoint_shards(
    model: nn.Module, name: str, tensor: torch.Tensor
) -> list[tuple[str, object, torch.Tensor]]:
    """The (parameter name, shard id, tensor) loads of one checkpoint tensor: the model's
    ``checkpoint_shards(name, tensor)`` when it has one and it returns a list (stacked expert
    weights), else one load through :func:`parameter_target`."""
    hook = getattr(model, "checkpoint_shards", None)
    shards = hook(name, tensor) if hook is not None else None
    if shards is None:
        target, shard = parameter_target(model, name)
        return [(target, shard, tensor)]
    return shards


def _check_quantized_dtype(name: str, tensor, param: nn.Parameter) -> None:
    """A float8 checkpoint tensor goes only into a float8 parameter (scales are checked by
    their quantized layer's loader)."""
    if name.endswith("_scale_inv"):
        return
    if tensor.element_size() == 1 and tensor.is_floating_point() and param.element_size() != 1:
        raise ValueError(
            f"checkpoint tensor {name} is {tensor.dtype}, but the engine keeps this parameter in "
            f"{param.dtype}: quantized embeddings, LM heads, norms and MoE experts are not "
            "supported, and FP8 linear layers need the checkpoint's quantization_config"
        )


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into its (possibly fused, stacked or sharded) parameter.

    The model provides ``packed_modules_mapping``, ``skip_checkpoint_tensor(name)`` and
    optionally ``checkpoint_shards(name, tensor)`` (see :func:`checkpoint_shards`); each
    parameter's ``weight_loader(param, tensor, shard_id)`` copies its part (cast to the
    parameter's dtype and device), and its ``shard_ids`` say which shards it expects. The
    safetensors tensors are :class:`CheckpointSlice` windows: only the slices the loaders keep
    are read (GGUF tensors arrive whole, see :func:`checkpoint_tensors`).

    Raises:
        KeyError: a checkpoint tensor with no matching parameter (e.g. a ``weight_scale_inv``
            of a layer the engine does not quantize).
        ValueError: a shape mismatch, a shard loaded twice, parameters the checkpoint does
            not provide, or a float8 tensor for a parameter that is not float8 (the weight
            would be silently cast without its scales).
    """
    params = dict(model.named_parameters())
    loaded: dict[str, list] = {}
    for name, full in checkpoint_tensors(model_dir):
        if model.skip_checkpoint_tensor(name):
            continue
        for target, shard, tensor in checkpoint_shards(model, name, full):
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint tensor {name} matches no model parameter ({target})")
            if shard in loaded.setdefault(target, []):
                raise ValueError(f"checkpoint tensor {name} loaded twice")
            _check_quantized_dtype(name, tensor, param)
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            loaded[target].append(shard)
    missing = [
        n
        for n, p in params.items()
        if sorted(map(str, loaded.get(n, []))) != sorted(map(str, getattr(p, "shard_ids", (None,))))
    ]
    if missing:
        raise ValueError(
            f"checkpoint {model_dir} lacks parameters: "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''}"
        )
