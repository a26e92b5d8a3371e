"""Block-FP8 linear layer through cuBLASLt's block-scaled FP8 GEMM (torch's ``scaled_mm``).

The same arithmetic as :func:`kernels.fp8_gemm.fp8_linear`: activations quantized per token in
groups of 128 (:func:`kernels.fp8_gemm.fp8_group_quant`), weights in float8_e4m3fn with one
float32 scale per 128 x 128 block (DeepSeek-V3's recipe, the Qwen3-FP8 checkpoints' layout), the
product accumulated in float32 by the tensor cores. cuBLASLt runs it from version 12.9 on sm_90
(Hopper) only; torch exposes it as ``torch.nn.functional.scaled_mm`` with
``ScalingType.BlockWise1x128`` (activations) and ``BlockWise128x128`` (weights), and infers the
same recipe in ``torch._scaled_mm`` from the scales' shapes. Layouts it requires
(``aten/src/ATen/native/cuda/ScaledBlas.cpp``): the activation scales ``[M, K / 128]``
column-major (``fp8_group_quant``'s layout), the weight scales ``[K / 128, N / 128]``
column-major with ``K / 128`` a multiple of 4 (so this path refuses other K rather than pad).
cuBLASLt also refuses (``CUBLAS_STATUS_NOT_SUPPORTED`` from its heuristic) an activation scale
matrix whose leading dimension, M, is not aligned (the H200 run of 2026-12-01: M = 97 failed,
multiples of 64 ran), so the caller pads M to :data:`CUBLAS_M_ALIGN` rows
(``fp8_group_quant(..., pad_rows_to=CUBLAS_M_ALIGN)``) and drops the padding rows' outputs.

It is a measured table kind (``"cublas"`` in ``kernels/configs/fp8_gemm_<device>.json``): the
FP8 sweep (``bench/fp8_sweep.py``) times it beside the Triton GEMM and checks it against the
float32 reference; nothing uses it on a device whose table does not pick it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.configs import device_name
from kernels.fp8_configs import CUBLAS_DTYPES, CUBLAS_USABLE, FP8_BLOCK

#: rows of the quantized activations (and of their column-major scales) a multiple of this
CUBLAS_M_ALIGN = 16


def cublas_block_fp8_supported(device: torch.device | str) -> bool:
    """Whether ``device`` may run the block-scaled cuBLASLt GEMM: CUDA compute capability 9.0
    and a torch with a scaled matmul (whether its cuBLASLt is >= 12.9 shows at the first call,
    which then raises)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0) and (
        hasattr(F, "scaled_mm") or hasattr(torch, "_scaled_mm")
    )


def probe_cublas(device: torch.device | str, n: int, k: int) -> tuple[bool, str]:
    """Run the block-scaled GEMM of one ``[N, K]`` layer shape on ``device`` at the smallest
    padded M (:data:`CUBLAS_M_ALIGN` rows), writing bf16 and fp16, against the float32 product
    (once per device name and shape; later calls return the stored answer), and record in
    ``kernels.fp8_configs.CUBLAS_USABLE`` whether it worked: a torch or cuBLASLt without the
    recipe, or one refusing this shape, fails here at model load instead of in a step. Call it
    outside CUDA-graph capture (it synchronizes).

    Returns:
        ``(usable, reason)``: reason is "" or the error's first line.
    """
    key = (device_name(device), n, k)
    if key in CUBLAS_USABLE:
        return CUBLAS_USABLE[key], ""
    reason = ""
    if not cublas_block_fp8_supported(device):
        reason = "needs CUDA sm_90 and torch's scaled_mm"
    else:
        try:
            check_cublas_operands(k, torch.bfloat16)
            # dtypes explicit: a model is built under a bf16 default dtype, and bf16 scales are
            # an "Invalid scaling configuration" to cuBLASLt
            m = CUBLAS_M_ALIGN
            f32 = dict(device=device, dtype=torch.float32)
            g = torch.Generator(device=device).manual_seed(0)
            xq = torch.randn(m, k, generator=g, **f32).to(torch.float8_e4m3fn)
            xs = torch.ones(-(-k // FP8_BLOCK[1]), m, **f32).t()
            w = torch.randn(n, k, generator=g, **f32).to(torch.float8_e4m3fn)
            ws = torch.ones(-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]), **f32)
            ref = xq.float() @ w.float().t()
            for dtype in CUBLAS_DTYPES:
                out = fp8_cublas_gemm(xq, xs, w, ws, None, dtype)
                torch.cuda.synchronize(device)
                tol = 2**-7 * ref.abs().max()
                if not torch.allclose(out.float(), ref, rtol=2**-7, atol=tol):
                    reason = f"its {dtype} result differs from the float32 product"
                    break
            del xq, w, ref
        except Exception as exc:  # noqa: BLE001 - any refusal means: not here, use Triton
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    CUBLAS_USABLE[key] = not reason
    return not reason, reason


def check_cublas_operands(k: int, out_dtype: torch.dtype) -> None:
    """Refuse what this path cannot take, before anything runs.

    Raises:
        ValueError: ``out_dtype`` not bf16/fp16 (cuBLASLt writes only those here), or ``K / 128``
            not a whole multiple of 4 (the weight scales would need padding).
    """
    if out_dtype not in CUBLAS_DTYPES:
        raise ValueError(f"the cuBLASLt FP8 path writes bf16/fp16, got {out_dtype}")
    if k % FP8_BLOCK[1] or (k // FP8_BLOCK[1]) % 4:
        raise ValueError(f"the cuBLASLt FP8 path needs K a multiple of 512, got K={k}")


def fp8_cublas_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``xq [M, K]`` float8_e4m3fn with scales ``xs`` float32 ``[M, K / 128]`` column-major
    (``kernels.fp8_gemm.fp8_group_quant``'s output, M a multiple of :data:`CUBLAS_M_ALIGN`)
    times the block-FP8 weight ``w [N, K]`` (float8_e4m3fn, scales ``ws``
    ``[ceil(N / 128), K / 128]``) -> ``[M, N]`` in ``out_dtype``, plus ``bias``.

    Raises:
        ValueError: as :func:`check_cublas_operands`; M not a multiple of
            :data:`CUBLAS_M_ALIGN`.
        RuntimeError / NotImplementedError: from torch where cuBLASLt < 12.9 or the GPU is not
            sm_90 (the sweep rejects the kind there).
    """
    check_cublas_operands(xq.shape[1], out_dtype)
    if xq.shape[0] % CUBLAS_M_ALIGN:
        raise ValueError(
            f"the cuBLASLt FP8 path takes M padded to a multiple of {CUBLAS_M_ALIGN}, got "
            f"M={xq.shape[0]} (fp8_group_quant(..., pad_rows_to=CUBLAS_M_ALIGN))"
        )
    scale_b = ws.float().contiguous().t()  # [K / 128, N / 128], column-major
    if hasattr(F, "scaled_mm"):
        st = F.ScalingType
        out = F.scaled_mm(
            xq,
            w.t(),
            xs,
            st.BlockWise1x128,
            scale_b,
            st.BlockWise128x128,
            output_dtype=out_dtype,
        )
    else:
        out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale_b, out_dtype=out_dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
