"""Static tile configurations of the block-FP8 kernels (:mod:`kernels.fp8_gemm`), per device,
shape and M bucket.

No autotuning at serve time (launches stay CUDA-graph capturable and the first request pays no
search): :func:`fp8_config` returns, in this order,

1. under the Triton interpreter, small tiles (tests cross tile boundaries with small shapes);
2. the entry of the device's measured table ``kernels/configs/fp8_gemm_<device>.json`` for the
   shape ``"N,K"`` and the M bucket of ``M`` (:func:`fp8_table_config`), written by
   ``bench/fp8_sweep.py --write-table``;
3. otherwise the built-in choice (:func:`default_fp8_config`): the fused small-M kernel for
   ``M <= GEMV_MAX_M``, the tiled GEMM above.

The table, as vLLM's per-shape ``w8a8_block_fp8_matmul`` JSON files are organised::

    {"<N>,<K>": {"<bucket>": {"kind": "gemm", "block_m": 64, "block_n": 128, "num_warps": 4,
                              "num_stages": 4, "group_m": 8, "split_k": 1, "fuse_quant": false,
                              "fp8_us": 12.3, ...}, ...}, ...}

Buckets are :data:`M_BUCKETS`; bucket ``b`` serves the M above the previous bucket up to ``b``
(``"64"``: M = 33..64; ``"16"``: the decode sizes M = 2..16, which the fused kernel runs at one
``BLOCK_M = 16`` tile whatever M is; ``"1"``: batch-1 decode, which may take the fused kernel's
CUDA-core variant, ``fma``), the last one every larger M too. A shape without a ``"1"`` entry
runs M = 1 on its ``"16"`` entry (what served M = 1 before that bucket existed). A shape, a
bucket or a device without an entry gets :func:`default_fp8_config` unchanged. Keys ending in
``_us``, ``_tflops`` or ``_err`` are measurements kept for the reader; any other key outside
:class:`Fp8Config`'s fields is an error.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from functools import cache

import torch
import triton

from kernels.configs import device_name, kernel_table, table_device, table_path
from kernels.gemv import NUM_COUNTERS
from kernels.interpreter import interpreting

#: the weight block and activation group the kernels take (``block_n``, ``block_k``)
FP8_BLOCK = (128, 128)

#: at most this many rows go through the fused small-M kernel without a table entry
GEMV_MAX_M = 32
#: the fused small-M kernel may serve M up to this many rows where the table says so
GEMV_TABLE_MAX_M = 64
#: the M buckets of the table (each the largest M it serves; the last also every larger M)
M_BUCKETS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: the most rows the fused small-M kernel's CUDA-core product (``Fp8Config.fma``) takes: one
#: (batch-1 decode; the multiply-adds grow with M while the tensor-core dot's are a fixed
#: 16-column tile)
FMA_MAX_M = 1

#: K elements one iteration of the small-M kernel may take (``Fp8Config.block_k``)
GEMV_BLOCK_KS = (128, 256, 512)
#: columns of the block-diagonal activation operand (``block_m * x_groups``): at least the
#: smallest tensor-core tile Triton takes, at most what keeps the accumulator in registers
X_COLS = (16, 128)

#: number of SMs the split heuristic aims at (H200: 132)
_TARGET_SMS = 132

#: Qwen3-8B's linear shapes ``(N, K)`` -> split-K of the small-M kernel at ``BLOCK_N = 64``:
#: about three programs per SM (qkv 4096->6144, o 4096->4096, gate_up 4096->24576,
#: down 12288->4096). ``python bench/fp8.py --sweep`` times alternatives.
GEMV_SPLITS = {(6144, 4096): 4, (4096, 4096): 6, (24576, 4096): 1, (4096, 12288): 6}

_MEASUREMENT_SUFFIXES = ("_us", "_tflops", "_err")


@dataclass(frozen=True)
class Fp8Config:
    """Tiles of one launch.

    ``kind`` "gemv": the fused small-M kernel (``block_m`` >= M rows quantized in registers,
    ``block_n`` output features per program, ``split_k`` K splits, the last-arriving one of an
    N tile summing them in the same launch).
    ``kind`` "gemm": the tiled tensor-core GEMM (``block_m x block_n`` tiles, ``group_m`` M tiles
    share a weight column in launch order for L2 reuse, ``split_k`` K splits reduced in the
    kernel by the last-arriving program, ``fuse_quant``: the GEMM quantizes the activation tiles
    itself instead of reading ``fp8_group_quant``'s output). ``num_warps`` and ``num_stages``
    are Triton's. ``fma`` ("gemv" only): the product in fp32 multiply-adds on the CUDA cores
    instead of the FP8 tensor-core dot, for ``block_m <= FMA_MAX_M`` rows and ``block_n <=
    128``. ``kind`` "cublas": cuBLASLt's block-scaled GEMM
    (:mod:`kernels.fp8_cublas`, sm_90); its tile fields are unused (:data:`CUBLAS_CONFIG`).

    Options of the small-M kernel (all off by default, which is the kernel the tables measured
    before they existed; ``kernels.fp8_gemm.fp8_gemv`` documents each):

    * ``block_k`` (128, 256 or 512): K elements a loop iteration takes, one to four 128-wide
      scale groups; above 128 only with ``fma`` or ``x_groups``.
    * ``x_groups`` (0: off; else a power of two with ``16 <= block_m * x_groups <= 128``): the
      block-diagonal activation operand -- the activations of ``x_groups`` K groups are
      quantized once before the loop into the columns of one MMA operand, the loop only
      accumulates tensor-core products, the scales are applied once after it. ``block_m`` may
      be 1 (batch 1). A program takes at most ``x_groups`` K groups, so the launch makes at
      least ``ceil(K / 128 / x_groups)`` splits whatever ``split_k`` says (:func:`gemv_k_split`).
    * ``scale_ahead`` (the tensor-core product without ``x_groups``): the next K block's weight
      scales are loaded one iteration early.
    * ``prefetch`` (``x_groups`` only): an L2 prefetch of the program's first four weight tiles
      before the activations are quantized.
    * ``bit_cvt`` (``fma`` only): float8 -> float16 by bit shifts instead of the conversion
      instruction.
    """

    kind: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    group_m: int = 8
    fuse_quant: bool = False
    fma: bool = False
    block_k: int = 128
    x_groups: int = 0
    scale_ahead: bool = False
    prefetch: bool = False
    bit_cvt: bool = False


#: the configuration of the cuBLASLt kind (no tiles of ours to choose)
CUBLAS_CONFIG = Fp8Config("cublas", 0, 0, 0, 0)

#: (device name, N, K) -> whether cuBLASLt's block-scaled GEMM ran that shape there, filled at
#: model load by ``kernels.fp8_cublas.probe_cublas``; a shape whose probe failed runs its table's
#: "cublas" entries on their recorded Triton fallback (or :func:`default_fp8_config`). A shape
#: never probed (kernel benchmarks) uses the entries as they are.
CUBLAS_USABLE: dict[tuple[str, int, int], bool] = {}
#: output dtypes cuBLASLt's block-scaled FP8 GEMM writes (other activations take the fallback)
CUBLAS_DTYPES = (torch.bfloat16, torch.float16)


def _gemv_split(n: int, k: int, block_n: int) -> int:
    if (n, k) in GEMV_SPLITS and block_n == 64:
        return GEMV_SPLITS[(n, k)]
    tiles = triton.cdiv(n, block_n)
    kb = triton.cdiv(k, FP8_BLOCK[1])
    return max(1, min(triton.cdiv(3 * _TARGET_SMS, tiles), kb // 4 or 1))


def gemv_k_split(k: int, cfg: Fp8Config) -> tuple[int, int]:
    """(splits, 128-wide K groups per split) of a small-M launch of ``cfg`` over ``K``: at most
    ``split_k`` splits, none empty, each a multiple of ``block_k / 128`` groups (an iteration's);
    with ``x_groups`` at most that many groups a split, so possibly more splits than
    ``split_k``. The tiled GEMM's split (``block_k`` 128, no ``x_groups``) is the same
    formula."""
    kb = triton.cdiv(k, FP8_BLOCK[1])
    step = cfg.block_k // FP8_BLOCK[1]
    split = max(1, min(cfg.split_k, kb))
    per = triton.cdiv(triton.cdiv(kb, split), step) * step
    if cfg.x_groups:
        per = min(per, cfg.x_groups)  # a multiple of step (parse_table_entry checks it)
    return triton.cdiv(kb, per), per


def default_fp8_config(m: int, n: int, k: int, kind: str | None = None) -> Fp8Config:
    """The built-in GPU tiles (what every device and shape without a table entry runs).

    ``kind`` None picks the kernel: "gemv" for ``M <= GEMV_MAX_M`` (decode: weight-bandwidth
    bound, quantization fused), else "gemm".
    """
    kind = kind or ("gemv" if m <= GEMV_MAX_M else "gemm")
    if kind == "gemv":
        bm = max(16, triton.next_power_of_2(m))
        return Fp8Config("gemv", bm, 64, 4, 4, split_k=_gemv_split(n, k, 64))
    if m <= 256:
        return Fp8Config("gemm", 64, 128, 4, 4, group_m=8)
    return Fp8Config("gemm", 128, 128, 8, 3, group_m=8)


def m_bucket(m: int) -> int:
    """The table bucket serving ``m`` rows: the smallest of :data:`M_BUCKETS` >= ``m`` (the last
    one above it)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def _pow2(v: int, lo: int, hi: int) -> bool:
    return lo <= v <= hi and v & (v - 1) == 0


def parse_table_entry(row: object, bucket: int, where: str = "fp8_gemm table") -> Fp8Config:
    """One bucket's entry of the table -> :class:`Fp8Config`, checked.

    Raises:
        ValueError: naming ``where`` and the bucket: not an object, an unknown key, a missing or
            mistyped field, an unknown ``kind``, tiles the kernels cannot run (``block_m`` /
            ``block_n`` not a power of two in 16..256 -- ``block_m`` 1 with ``fma``, which also
            needs a "gemv" entry and ``block_n <= 128`` -- ``num_warps`` not 2/4/8,
            ``num_stages`` outside 1..8, ``split_k`` / ``group_m`` below 1), a "gemv" entry
            whose ``block_m`` cannot hold the bucket's rows or exceeds ``GEMV_TABLE_MAX_M``,
            ``fuse_quant`` on a "gemv" entry; a "cublas" entry with tile fields or a malformed
            ``fallback``.

    A "cublas" entry is the kind, measurements and optionally ``fallback``: the fastest Triton
    configuration of the bucket (an entry of its own), what the bucket runs where cuBLASLt's
    block-scaled GEMM failed its load-time probe (:func:`table_fallback`).
    """
    at = f"{where}, bucket {bucket}"
    if not isinstance(row, dict):
        raise ValueError(f"{at}: expected an object of tile fields, got {type(row).__name__}")
    if row.get("kind") == "cublas":  # cuBLASLt picks its own tiles: measurements only
        extra = [
            key
            for key in row
            if key not in ("kind", "fallback") and not key.endswith(_MEASUREMENT_SUFFIXES)
        ]
        if extra:
            raise ValueError(f"{at}: a cublas entry takes no tile fields, got {sorted(extra)}")
        if "fallback" in row:
            fallback = row["fallback"]
            if isinstance(fallback, dict) and fallback.get("kind") == "cublas":
                raise ValueError(f"{at}: the fallback of a cublas entry must be a Triton kernel")
            parse_table_entry(fallback, bucket, f"{where} (fallback)")
        return CUBLAS_CONFIG
    names = {f.name: f for f in fields(Fp8Config)}
    unknown = [key for key in row if key not in names and not key.endswith(_MEASUREMENT_SUFFIXES)]
    if unknown:
        raise ValueError(f"{at}: unknown keys {sorted(unknown)} (fields: {sorted(names)})")
    required = [f.name for f in fields(Fp8Config) if f.default is MISSING]
    missing = [name for name in required if name not in row]
    if missing:
        raise ValueError(f"{at}: missing {missing}")
    values = {}
    for name in names:
        if name not in row:
            continue
        v = row[name]
        want = {"kind": str}.get(name, int if names[name].type in (int, "int") else bool)
        if type(v) is not want:  # bool is an int subclass: exact types only
            raise ValueError(f"{at}: {name} must be {want.__name__}, got {v!r}")
        values[name] = v
    cfg = Fp8Config(**values)
    if cfg.kind not in ("gemm", "gemv"):
        raise ValueError(f"{at}: kind must be 'gemm', 'gemv' or 'cublas', got {cfg.kind!r}")
    problems = []
    if cfg.fma:
        if cfg.kind != "gemv" or not _pow2(cfg.block_m, 1, FMA_MAX_M) or cfg.block_n > 128:
            problems.append(
                f"fma is a gemv option for block_m a power of two in 1..{FMA_MAX_M} and block_n "
                f"<= 128 (one weight-scale block), got {cfg.kind} {cfg.block_m}x{cfg.block_n}"
            )
    elif cfg.x_groups:
        if not _pow2(cfg.block_m, 1, 16):
            problems.append(f"x_groups takes block_m a power of two in 1..16, got {cfg.block_m}")
    elif not _pow2(cfg.block_m, 16, 256):
        problems.append(f"block_m {cfg.block_m} is not a power of two in 16..256")
    problems += gemv_option_problems(cfg)
    if not _pow2(cfg.block_n, 16, 256):
        problems.append(f"block_n {cfg.block_n} is not a power of two in 16..256")
    if cfg.num_warps not in (2, 4, 8):
        problems.append(f"num_warps {cfg.num_warps} is not 2, 4 or 8")
    if not 1 <= cfg.num_stages <= 8:
        problems.append(f"num_stages {cfg.num_stages} is outside 1..8")
    if cfg.split_k < 1 or cfg.group_m < 1:
        problems.append(f"split_k {cfg.split_k} and group_m {cfg.group_m} must be >= 1")
    if cfg.kind == "gemv":
        if cfg.block_m < bucket or cfg.block_m > GEMV_TABLE_MAX_M:
            problems.append(
                f"a gemv entry needs bucket {bucket} <= block_m {cfg.block_m} <= {GEMV_TABLE_MAX_M}"
            )
        if cfg.fuse_quant:
            problems.append("fuse_quant is a gemm option (the gemv always quantizes itself)")
    if problems:
        raise ValueError(f"{at}: " + "; ".join(problems))
    return cfg


def gemv_option_problems(cfg: Fp8Config) -> list[str]:
    """What is wrong with the small-M kernel's options of ``cfg`` (:class:`Fp8Config`)."""
    out = []
    gemv_dot = cfg.kind == "gemv" and not cfg.fma
    if cfg.block_k not in GEMV_BLOCK_KS:
        out.append(f"block_k {cfg.block_k} is not one of {GEMV_BLOCK_KS}")
    elif cfg.block_k != FP8_BLOCK[1] and not (cfg.fma or cfg.x_groups):
        out.append(f"block_k {cfg.block_k} needs fma or x_groups (the other kernels take 128)")
    if cfg.x_groups:
        cols = cfg.block_m * cfg.x_groups
        if not gemv_dot:
            out.append("x_groups is an option of the gemv's tensor-core product (not fma)")
        elif not _pow2(cfg.x_groups, 1, X_COLS[1]) or not X_COLS[0] <= cols <= X_COLS[1]:
            out.append(
                f"x_groups {cfg.x_groups} must be a power of two with block_m * x_groups in "
                f"{X_COLS[0]}..{X_COLS[1]}, got {cols}"
            )
        elif cfg.block_k // FP8_BLOCK[1] > cfg.x_groups:
            out.append(f"block_k {cfg.block_k} spans more than x_groups {cfg.x_groups} groups")
    elif cfg.x_groups < 0:
        out.append(f"x_groups {cfg.x_groups} is negative")
    if cfg.scale_ahead and not (gemv_dot and not cfg.x_groups):
        out.append("scale_ahead is an option of the gemv's tensor-core product without x_groups")
    if cfg.prefetch and not cfg.x_groups:
        out.append("prefetch is an option of x_groups")
    if cfg.bit_cvt and not (cfg.kind == "gemv" and cfg.fma):
        out.append("bit_cvt is an option of the gemv's fma product")
    return out


@cache
def _table_entry(name: str, n: int, k: int, bucket: int) -> Fp8Config | None:
    shape = kernel_table("fp8_gemm", name).get(f"{n},{k}")
    if shape is None:
        return None
    where = f"{table_path('fp8_gemm', table_device('fp8_gemm', name))} entry {n},{k}"
    if not isinstance(shape, dict):
        raise ValueError(f"{where}: expected an object keyed by M bucket")
    bad = [key for key in shape if key not in {str(b) for b in M_BUCKETS}]
    if bad:
        raise ValueError(f"{where}: unknown M buckets {bad} (buckets: {list(M_BUCKETS)})")
    row = shape.get(str(bucket))
    if row is None and bucket == 1:  # no batch-1 entry: M = 1 runs as the decode bucket says
        return _table_entry(name, n, k, 16)
    return None if row is None else parse_table_entry(row, bucket, where)


@cache
def table_fallback(name: str, n: int, k: int, bucket: int) -> Fp8Config | None:
    """The ``fallback`` Triton configuration of a "cublas" entry (None: no such entry or no
    fallback in it); checked when the entry is (:func:`parse_table_entry`)."""
    if _table_entry(name, n, k, bucket) != CUBLAS_CONFIG:
        return None
    shape = kernel_table("fp8_gemm", name)[f"{n},{k}"]
    row = shape[str(bucket)] if str(bucket) in shape else shape["16"]  # bucket 1 without entry
    return parse_table_entry(row["fallback"], bucket) if "fallback" in row else None


def check_fp8_table(device: torch.device | str, n: int, k: int) -> bool:
    """Parse every M bucket of the ``[N, K]`` entry of ``device``'s table (none: nothing to do),
    so that a malformed entry fails the engine's start rather than a request's step.

    Returns:
        Whether a bucket of the entry picks the "cublas" kind (the caller then probes it:
        ``kernels.fp8_cublas.probe_cublas``).

    Raises:
        ValueError: as :func:`fp8_table_config`, for the first malformed bucket.
    """
    if torch.device(device).type != "cuda":
        return False
    name = device_name(device)
    entries = [_table_entry(name, n, k, bucket) for bucket in M_BUCKETS]
    return any(cfg is not None and cfg.kind == "cublas" for cfg in entries)


def fp8_table_config(
    name: str, m: int, n: int, k: int, kind: str | None = None
) -> Fp8Config | None:
    """The measured tiles for ``[M, K] x [K, N]`` on the device called ``name`` (see the module
    docstring), or None: no table, shape or bucket entry, or an entry of another ``kind`` than
    the one asked for.

    Raises:
        ValueError: a malformed entry (:func:`parse_table_entry`), an unknown bucket key, a
            shape entry that is not an object.
        json.JSONDecodeError: a table file that is not JSON.
    """
    bucket = m_bucket(m)
    cfg = _table_entry(name, n, k, bucket)
    if cfg is None or (kind is not None and cfg.kind != kind):
        return None
    return cfg


def fp8_config(
    m: int,
    n: int,
    k: int,
    kind: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Fp8Config:
    """The static tile configuration for an ``[M, K] x [K, N]`` FP8 product on ``device``.

    ``kind`` None lets the table or :func:`default_fp8_config` pick the kernel; "gemv" or "gemm"
    forces one (a table entry of the other kind is then not used). ``device`` None (or a CPU
    device) reads no table. ``dtype``: the activations' (and output's) dtype; a "cublas" entry
    serves only :data:`CUBLAS_DTYPES` and shapes whose load-time probe did not fail, the others
    get the entry's Triton fallback.

    Raises:
        ValueError: a malformed table entry for this shape and bucket.
    """
    if interpreting():
        kind = kind or ("gemv" if m <= GEMV_MAX_M else "gemm")
        if kind == "gemv":
            bm = max(16, triton.next_power_of_2(m))
            return Fp8Config("gemv", bm, 32, 4, 1, split_k=_gemv_split(n, k, 32))
        return Fp8Config("gemm", 32, 32, 4, 1, group_m=2)
    if device is not None and torch.device(device).type == "cuda":
        name = device_name(device)
        cfg = fp8_table_config(name, m, n, k, kind)
        if (
            cfg is not None
            and cfg.kind == "cublas"
            and (
                not CUBLAS_USABLE.get((name, n, k), True)
                or (dtype is not None and dtype not in CUBLAS_DTYPES)
            )
        ):
            # probe failed at load, or float32 activations: the bucket's fastest Triton tiles
            # (or the built-in ones)
            cfg = table_fallback(name, n, k, m_bucket(m))
            if cfg is not None and kind is not None and cfg.kind != kind:
                cfg = None
        if cfg is not None:
            if (
                cfg.kind == "gemm"
                and cfg.split_k > 1
                and not split_k_fits(m, n, cfg.block_m, cfg.block_n, cfg.split_k)
            ):
                # the last bucket serves every larger M: past the split-K kernel's counters
                # or 2^31 partial elements, the same tiles run unsplit
                cfg = replace(cfg, split_k=1)
            return cfg
    return default_fp8_config(m, n, k, kind)


def split_k_fits(m: int, n: int, block_m: int, block_n: int, split: int) -> bool:
    """Whether a ``split``-way split-K GEMM launch on an ``m x n`` output in ``block_m x
    block_n`` tiles has an arrival counter per output tile and fewer than 2^31 fp32 partial
    elements (the limits ``kernels.fp8_gemm`` enforces at launch)."""
    tiles = -(-m // block_m) * -(-n // block_n)
    return tiles <= NUM_COUNTERS and split * m * n < 2**31
