"""Block FP8 linear layers (Qwen3-FP8 / DeepSeek-V3 fine-grained FP8).

Layout of a quantized layer (the checkpoint's, kept on the device): ``weight`` float8_e4m3fn
``[out_per_rank, in_per_rank]`` and ``weight_scale_inv`` float32
``[ceil(out_per_rank / 128), ceil(in_per_rank / 128)]``; the real weight is ``weight * scale``
block by block. The forward quantizes activations per token in groups of 128 features and runs
``kernels.fp8_gemm.fp8_linear`` where the device has FP8 tensor cores (CUDA sm_89+), else
``kernels.reference.fp8_linear_ref``, which dequantizes in float32 (CPU, older GPUs; same
arithmetic, so the two agree up to float32 summation order).

Loading: a checkpoint FP8 weight is copied through the layer's own ``weight_loader`` (its
shard and tensor-parallel slicing); a ``weight_scale_inv`` is expanded to one row (column) per
weight row (column) along the dimension the layer slices, loaded through that same loader, and
subsampled back, so the scale blocks follow the weight's slicing exactly. That needs every
shard and every rank's slice to start and end on a block boundary, which
:func:`finalize_quantization` checks (vLLM makes the same requirement). With
``checkpoint_quantized=False`` (``--quantization fp8``) a high-precision weight is quantized by
:func:`quantize_fp8_blocks` (transformers' ``Fp8Quantize`` arithmetic) on the parameter's
device and loaded the same way.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from kernels.reference import FP8_MAX, fp8_linear_ref

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
#: scale dtypes a checkpoint may store (upcast to float32 exactly)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.no_grad()
def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight ``[N, K]`` into float8_e4m3fn blocks (transformers' ``Fp8Quantize``).

    Per ``block[0] x block[1]`` block (edge blocks may be partial): ``scale = 448 / amax`` (1 for
    an all-zero block), ``q = clamp(w * scale, -448, 448)`` rounded to nearest even,
    ``weight_scale_inv = 1 / scale``. Computed in float32 on ``w``'s device.

    Returns:
        ``q`` float8_e4m3fn ``[N, K]``, ``scale_inv`` float32 ``[ceil(N / bn), ceil(K / bk)]``.
    """
    n, k = w.shape
    bn, bk = block
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    wf = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = wf.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    ones = torch.ones_like(amax)
    scale = torch.where(amax > 0, torch.full_like(amax, FP8_MAX) / amax, ones)
    q = (blocks * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), ones / scale


@functools.lru_cache(maxsize=8)
def _backend_for(device_type: str, index: int | None) -> str:
    if device_type != "cuda":
        return "reference"
    return "triton" if torch.cuda.get_device_capability(index) >= (8, 9) else "reference"


def fp8_backend(device: torch.device | str) -> str:
    """ "triton" (FP8 tensor-core kernels) on CUDA devices of compute capability 8.9 or more,
    else "reference" (dequantize and multiply in float32)."""
    device = torch.device(device)
    return _backend_for(device.type, device.index)


@torch.library.custom_op("qwen_serve::fp8_linear", mutates_args=())
def fp8_linear_op(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``kernels.fp8_gemm.fp8_linear`` as one opaque op (whole-model ``torch.compile``)."""
    from kernels.fp8_gemm import fp8_linear

    return fp8_linear(x, weight, scale, bias)


@fp8_linear_op.register_fake
def _fp8_linear_fake(x, weight, scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


class Fp8LinearMethod:
    """Creates, loads and multiplies the block-FP8 weight of one linear layer.

    Args:
        config: the model's quantization, an ``engine.core.config.QuantizationConfig`` with
            ``method == "fp8"`` (layers rank beside ``engine.core``, so it is not imported).
    """

    def __init__(self, config):
        self.config = config
        self.block = tuple(config.weight_block_size)

    # ------------------------------------------------------------------ parameters
    def create_weights(self, layer: nn.Module, out_per_rank: int, in_per_rank: int) -> None:
        """Register ``layer.weight`` (float8) and ``layer.weight_scale_inv`` (float32) on the
        current default device."""
        bn, bk = self.block
        layer.weight = nn.Parameter(
            torch.empty(out_per_rank, in_per_rank, dtype=FP8_DTYPE), requires_grad=False
        )
        layer.weight.weight_loader = functools.partial(self.load_weight, layer)
        layer.weight_scale_inv = nn.Parameter(
            torch.empty(_cdiv(out_per_rank, bn), _cdiv(in_per_rank, bk), dtype=torch.float32),
            requires_grad=False,
        )
        layer.weight_scale_inv.weight_loader = functools.partial(self.load_scale, layer)
        # a quantized checkpoint brings the scales (finalize_quantization copies the weight's
        # shard ids); quantized at load, the weight's loader writes them
        layer.weight_scale_inv.shard_ids = (None,) if self.config.checkpoint_quantized else ()

    def load_weight(self, layer, param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        """A checkpoint ``weight`` (or one shard of a fused layer).

        Raises:
            ValueError: an FP8 checkpoint whose tensor is not float8_e4m3fn (a layer it leaves
                unquantized must be in ``modules_to_not_convert``); a high-precision checkpoint
                (``--quantization fp8``) with a float8 tensor; shape mismatches.
        """
        if self.config.checkpoint_quantized:
            if tensor.dtype != FP8_DTYPE:
                raise ValueError(
                    f"{tensor.dtype} weight, but the checkpoint's fp8 quantization_config "
                    "quantizes this layer (float8_e4m3fn weight + weight_scale_inv expected; "
                    "list unquantized layers in modules_to_not_convert)"
                )
            layer.weight_loader(param, tensor, shard_id)
            return
        if not tensor.is_floating_point() or tensor.element_size() < 2:
            raise ValueError(
                f"--quantization fp8 quantizes high-precision weights at load; got {tensor.dtype} "
                "(a checkpoint already in FP8 must say so in its quantization_config)"
            )
        q, s = quantize_fp8_blocks(_read(tensor).to(param.device), self.block)
        layer.weight_loader(param, q, shard_id)
        self._load_scale_into(layer, s, shard_id)

    def load_scale(self, layer, param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        """A checkpoint ``weight_scale_inv`` (or one shard's).

        Raises:
            ValueError: a scale that is not float32/bfloat16/float16, or of the wrong shape.
        """
        if tensor.dtype not in _SCALE_DTYPES:
            raise ValueError(
                f"weight_scale_inv of dtype {tensor.dtype} is not supported (float32 expected)"
            )
        try:
            self._load_scale_into(layer, _read(tensor), shard_id)
        except ValueError as exc:
            raise ValueError(
                f"weight_scale_inv of shape {tuple(tensor.shape)} does not match the weight's "
                f"128x128 blocks ({exc})"
            ) from None

    def _load_scale_into(self, layer, scale: torch.Tensor, shard_id) -> None:
        """Copy block scales through the layer's loader at the weight's resolution along the
        sliced dimension (rows: fused or column-parallel; columns: row-parallel)."""
        param = layer.weight_scale_inv
        bn, bk = self.block
        rows, cols = _sliced_dims(layer)
        src = scale.to(device=param.device, dtype=torch.float32)
        if not (rows or cols):
            layer.weight_loader(param, src, shard_id)
            return
        dst = param.data
        if rows:
            dst, src = dst.repeat_interleave(bn, 0), src.repeat_interleave(bn, 0)
        if cols:
            dst, src = dst.repeat_interleave(bk, 1), src.repeat_interleave(bk, 1)
        layer.weight_loader(dst, src, shard_id)
        if rows:
            dst = dst[::bn]
        if cols:
            dst = dst[:, ::bk]
        param.data.copy_(dst)

    @torch.no_grad()
    def init_random(self, layer, generator: torch.Generator, std: float) -> None:
        """Dummy weights: N(0, std) drawn in float32 on the device, then block-quantized."""
        w = torch.empty(layer.weight.shape, dtype=torch.float32, device=layer.weight.device)
        w.normal_(0.0, std, generator=generator)
        q, s = quantize_fp8_blocks(w, self.block)
        layer.weight.data.copy_(q)
        layer.weight_scale_inv.data.copy_(s)

    # --------------------------------------------------------------------- forward
    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., in_per_rank]`` -> ``[..., out_per_rank]`` in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        w, s = layer.weight, layer.weight_scale_inv
        if fp8_backend(x.device) == "triton":
            y = fp8_linear_op(x2, w, s, bias)
        else:
            y = fp8_linear_ref(x2, w, s, bias, self.block)
        return y.reshape(*lead, w.shape[0])

    def validate(self, layer, name: str) -> None:
        """Check that the layer's shards and rank slices are whole blocks.

        Raises:
            ValueError: naming the module and the size that is not a multiple of 128; a
                malformed entry for the layer's shape in the device's measured FP8 tile table
                (``kernels/fp8_configs.check_fp8_table``), at start rather than in a step.
        """
        bn, bk = self.block
        rows, cols = _sliced_dims(layer)
        sizes = list(getattr(layer, "output_sizes", []))
        if hasattr(layer, "q_size"):
            sizes = [layer.q_size, layer.kv_size]
        if rows:
            sizes.append(layer.weight.shape[0])
        for size in sizes:
            if size % bn:
                raise ValueError(
                    f"{name}: {size} output features are not a multiple of the FP8 block "
                    f"{bn}; fused (q/k/v, gate/up) and tensor-parallel FP8 layers need "
                    "block-aligned shards"
                )
        if cols and layer.weight.shape[1] % bk:
            raise ValueError(
                f"{name}: {layer.weight.shape[1]} input features per rank are not a multiple "
                f"of the FP8 block {bk}"
            )
        if fp8_backend(layer.weight.device) == "triton":  # the measured tiles of this shape
            from kernels.fp8_configs import check_fp8_table

            if check_fp8_table(layer.weight.device, *layer.weight.shape):
                _probe_cublas_once(layer.weight.device, *layer.weight.shape)


def _probe_cublas_once(device: torch.device, n: int, k: int) -> None:
    """The device's table sends some M of this ``[N, K]`` shape to cuBLASLt's block-scaled
    GEMM: check it runs here, once per device and shape (``kernels.fp8_cublas.probe_cublas``),
    and say so when it does not (those M then run on the bucket's Triton tiles)."""
    from kernels.configs import device_name
    from kernels.fp8_configs import CUBLAS_USABLE
    from kernels.fp8_cublas import probe_cublas

    if (device_name(device), n, k) in CUBLAS_USABLE:
        return
    usable, reason = probe_cublas(device, n, k)
    if usable:
        log.info("FP8 %dx%d: cuBLASLt block-scaled GEMM runs the M its tile table gives it", n, k)
    else:
        log.warning(
            "FP8 %dx%d: cuBLASLt block-scaled GEMM unavailable here (%s); the tile table's "
            "cuBLASLt entries run on the Triton GEMM instead",
            n,
            k,
            reason,
        )


def _read(tensor) -> torch.Tensor:
    """A checkpoint tensor, or a lazy safetensors window
    (``engine.loader.safetensors_loader.CheckpointSlice``) read now."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.materialize()


def _sliced_dims(layer) -> tuple[bool, bool]:
    """(rows, columns): which weight dimensions the layer's loader slices or places shards on."""
    fused = len(getattr(layer.weight, "shard_ids", (None,))) > 1
    row_split = layer.tp_size > 1 and layer.weight.shape[1] != layer.input_size
    col_split = layer.tp_size > 1 and not row_split
    return fused or col_split, row_split


def make_quant_method(config) -> Fp8LinearMethod | None:
    """The linear method of ``config`` (None: unquantized).

    Raises:
        ValueError: a method other than fp8.
    """
    if config is None:
        return None
    if config.method != "fp8":
        raise ValueError(f"quantization method {config.method!r} is not supported")
    return Fp8LinearMethod(config)


def _unquantize(layer) -> None:
    """Give ``layer`` back a plain weight in the default dtype (a module the config excludes)."""
    old = layer.weight
    w = nn.Parameter(torch.empty(old.shape, device=old.device))
    w.weight_loader = layer.weight_loader
    w.shard_ids = old.shard_ids
    if hasattr(old, "checkpoint_shapes"):
        w.checkpoint_shapes = old.checkpoint_shapes
    layer.weight = w
    del layer.weight_scale_inv
    layer.quant_method = None


def finalize_quantization(model: nn.Module) -> None:
    """After a model is built: drop the quantization of the modules its config excludes
    (``modules_to_not_convert``, matched on the checkpoint names, so a fused ``qkv_proj`` is
    excluded when ``q_proj``, ``k_proj`` and ``v_proj`` all are), check block alignment, and let
    the scales expect the same shards as their weights.

    Raises:
        ValueError: a fused layer only partly excluded, or a misaligned shard
            (:meth:`Fp8LinearMethod.validate`).
    """
    fused: dict[str, list[str]] = {}
    for frag, (target, _) in getattr(model, "packed_modules_mapping", {}).items():
        fused.setdefault(target, []).append(frag)
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        prefix, _, leaf = name.rpartition(".")
        names = [f"{prefix}.{f}" if prefix else f for f in fused.get(leaf, [leaf])]
        skips = [method.config.skips(n) for n in names]
        if all(skips):
            _unquantize(module)
            continue
        if any(skips):
            raise ValueError(
                f"{name}: modules_to_not_convert excludes only part of the fused layer "
                f"({[n for n, s in zip(names, skips) if s]} of {names})"
            )
        method.validate(module, name)
        if method.config.checkpoint_quantized:
            module.weight_scale_inv.shard_ids = module.weight.shard_ids
