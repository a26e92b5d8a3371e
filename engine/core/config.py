"""Frozen configuration objects: the model (read from a Hugging Face config.json) and the engine.

Pure Python: dtypes are names ("float32", "bfloat16", "float16"); the worker maps them to torch
dtypes (``engine.worker.device.torch_dtype``). Runtime facts such as the number of KV blocks
that fit in memory are not stored here; the model runner returns them in :class:`CacheInfo`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

#: accepted dtype names -> canonical name
DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}

#: ``architectures`` entry assumed for a config.json without one, by ``model_type``
DEFAULT_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

#: values of ``EngineConfig.load_format``: weights from the checkpoint's safetensors ("auto"), or
#: random weights from ``EngineConfig.seed`` generated on the device (benchmarks, no files)
LOAD_FORMATS = ("auto", "dummy")

#: values of ``EngineConfig.quantization`` besides None (the checkpoint's own format)
QUANTIZATION_METHODS = ("fp8",)
#: default bound on the query-key pairs of prompt attention a step carries while requests decode
#: (``EngineConfig.max_prefill_attention_with_decodes``): 2 Mi pairs, about four whole
#: 1,024-token prompts or a 64-row chunk over 32k cached keys; chosen by the long-context sweep
#: (docs/benchmarks.md, issue 20)
DEFAULT_MAX_PREFILL_ATTENTION_WITH_DECODES = 2 * 1024 * 1024

#: tokens per KV block on CUDA when ``EngineConfig.block_size`` is None: 128-token pages hold
#: whole 128-key tiles of the prefill kernel's TMA loads; on the H200 a lone 32k-token prompt's
#: first token came 12 % sooner than with 16-token pages (374 -> 328 ms engine-only, attention
#: 293 -> 245 ms) at the same decode speed (docs/benchmarks.md, 2026-12-04)
DEFAULT_CUDA_BLOCK_SIZE = 128

#: ``EngineConfig.lone_prompt_min_tokens`` on CUDA when unset: from this length a prompt on an
#: idle engine is prefilled in one step with cuDNN's attention (H200, Qwen3-0.6B, 32k tokens:
#: first token 328 -> 280 ms engine-only; an 8k prompt in one eager step took 48.5 ms against
#: 39.0 in nine graph steps: docs/benchmarks.md, 2026-12-04, second session)
DEFAULT_LONE_PROMPT_MIN_TOKENS = 16384

#: the one FP8 weight block the kernels take: ``[block_n, block_k]`` (DeepSeek-V3, Qwen3-FP8)
FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class QuantizationConfig:
    """How the linear layers of a model are quantized (today: block FP8 only).

    The format is DeepSeek-V3's fine-grained FP8 (DeepSeek-AI, *DeepSeek-V3 Technical Report*,
    2024, section 3.3), as Qwen's ``-FP8`` releases store it and transformers'
    ``FineGrainedFP8Config`` reads it: each linear ``weight`` is float8_e4m3fn ``[out, in]``
    with a float32 ``weight_scale_inv`` ``[ceil(out / 128), ceil(in / 128)]`` (the weight is
    ``weight * scale`` block by block), and activations are quantized on the fly per token in
    groups of 128 features (``activation_scheme="dynamic"``).

    Attributes:
        method: "fp8".
        weight_block_size: ``(block_n, block_k)``, always :data:`FP8_BLOCK`.
        modules_to_not_convert: module names (checkpoint names, e.g. ``"lm_head"`` or
            ``"model.layers.0.mlp.gate"``) left unquantized; matched like transformers'
            ``should_convert_module`` (:meth:`skips`).
        checkpoint_quantized: True when the checkpoint stores FP8 weights and scales; False when
            a high-precision checkpoint is quantized at load (``--quantization fp8``).
    """

    method: str
    weight_block_size: tuple[int, int] = FP8_BLOCK
    modules_to_not_convert: tuple[str, ...] = ()
    checkpoint_quantized: bool = True

    def skips(self, module_name: str) -> bool:
        """Whether checkpoint module ``module_name`` stays unquantized: a pattern matches it from
        the start up to a module boundary (as a regex: ``"layer.1"`` matches ``"layer.1.attn"``,
        not ``"layer.11.attn"``), or it ends with a pattern (transformers' rule)."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return any(
            re.match(rf"(?:{key}){boundary}", module_name) or module_name.endswith(key)
            for key in self.modules_to_not_convert
        )

    @staticmethod
    def from_hf(qc: dict) -> QuantizationConfig:
        """Read a config.json ``quantization_config``.

        Raises:
            ValueError: a method other than ``fp8`` (naming it), a format other than e4m3, a
                static activation scheme, no or another ``weight_block_size`` than
                ``[128, 128]``, or power-of-two (ue8m0) scales.
        """
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(
                f"checkpoint quantization method {method!r} is not supported; this engine "
                "serves fp8 (block-quantized float8_e4m3fn weights, weight_block_size "
                "[128, 128], dynamic activations) and unquantized checkpoints"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint format {fmt!r} is not supported (only e4m3)")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(
                f"fp8 activation_scheme {scheme!r} is not supported (only dynamic: activations "
                "quantized per token in groups of 128 at run time; no static input scales)"
            )
        block = qc.get("weight_block_size")
        if block is None or tuple(block) != FP8_BLOCK:
            raise ValueError(
                f"fp8 weight_block_size {block!r} is not supported; only block-quantized "
                f"checkpoints with weight_block_size {list(FP8_BLOCK)} are (per-tensor or "
                "per-channel FP8 is not)"
            )
        scale_fmt = qc.get("scale_fmt") or "float"
        if scale_fmt != "float":
            raise ValueError(
                f"fp8 scale_fmt {scale_fmt!r} is not supported (only float32 weight_scale_inv)"
            )
        skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
        return QuantizationConfig(
            method="fp8",
            weight_block_size=FP8_BLOCK,
            modules_to_not_convert=tuple(str(m) for m in skip),
            checkpoint_quantized=True,
        )


def parse_dtype(name: str | None) -> str | None:
    """Canonical dtype name of ``name`` ("float32", "bfloat16", "float16"); None for None/"auto".

    Raises:
        ValueError: unknown name.
    """
    if name is None or name == "auto":
        return None
    name = str(name).removeprefix("torch.")
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}; expected one of auto, float32, bfloat16, float16"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3 (``model_type="qwen3"``), Qwen2 (``"qwen2"``) or Qwen3-MoE
    (``"qwen3_moe"``) decoder.

    Qwen3 has per-head RMSNorm on q and k (``qk_norm``) and no q/k/v bias; Qwen2 has q/k/v bias
    and no q/k norm. ``architecture`` is the first ``architectures`` entry of config.json (the
    key of the model registry, ``engine.models.registry``); ``dtype`` the checkpoint's dtype name.

    Mixture of experts (Qwen3-MoE, transformers' names): ``num_experts`` routed experts per
    sparse layer (0: a dense model), each token goes to its ``num_experts_per_tok`` most probable
    experts, whose probabilities are renormalised to sum to one when ``norm_topk_prob``; expert
    MLPs have ``moe_intermediate_size`` features. Layer ``i`` is sparse when it is not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (:meth:`is_moe_layer`); the
    other layers have a dense MLP of ``intermediate_size``. ``router_aux_loss_coef`` (training
    only) is not read.

    ``quantization``: how the linear layers are quantized (None: not at all). ``from_hf`` gives
    the checkpoint's ``quantization_config``; :func:`resolve_quantization` adds the engine's
    ``--quantization`` and the model runner builds the model with the result.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: str
    rope_scaling: RopeScaling | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    quantization: QuantizationConfig | None = None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has routed experts (transformers' rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def check_quantization(self, quantization: QuantizationConfig | None) -> None:
        """Refuse a quantization this architecture cannot run (``quantization``: what the
        model runs with, :func:`resolve_quantization`'s; None: none).

        Raises:
            ValueError: any quantization of a mixture-of-experts model (the fused MoE kernel,
                ``kernels/fused_moe.py``, takes bfloat16/float16/float32 expert weights only).
        """
        if quantization is not None and self.num_experts:
            raise ValueError(
                f"{quantization.method} quantization of Qwen3-MoE is not supported: the "
                "fused MoE kernel (kernels/fused_moe.py) takes bfloat16/float16/float32 expert "
                "weights only; serve the unquantized checkpoint"
            )

    def check_tensor_parallel(
        self, tp_size: int, quantization: QuantizationConfig | None = None
    ) -> None:
        """Refuse a tensor-parallel size the checkpoint's shapes do not split over (Megatron
        sharding, see docs/architecture.md): query heads, KV heads (split, or replicated when
        ``tp_size`` is a multiple of them), the dense and expert MLP features, the vocabulary
        (vocab-parallel embedding and LM head); and any quantization with ``tp_size`` > 1.

        ``quantization``: what the model runs with (:func:`resolve_quantization` of the
        checkpoint's and ``--quantization``); None: the checkpoint's own (``self.quantization``).
        Tensor parallelism of quantized layers is not implemented (the FP8 weights' per-block
        ``weight_scale_inv`` are not split per rank), so a quantized model is refused with
        ``tp_size`` > 1; the message also names the MLP slices that would cut the quantization
        blocks (``weight_block_size``), which even a sharded scale could not serve.

        Raises:
            ValueError: naming every dimension that does not divide (none for ``tp_size`` 1),
                or the quantization.
        """
        if tp_size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {tp_size}")
        if tp_size == 1:
            return
        problems = []

        def split(name: str, size: int) -> None:
            if size % tp_size:
                problems.append(f"{name} = {size} is not divisible by {tp_size}")

        split("num_attention_heads", self.num_attention_heads)
        kv = self.num_key_value_heads
        if kv % tp_size and tp_size % kv:
            problems.append(
                f"num_key_value_heads = {kv} neither divides by {tp_size} nor divides "
                f"{tp_size} (replicated KV heads)"
            )
        dense = self.num_hidden_layers > self.num_moe_layers
        if dense:
            split("intermediate_size", self.intermediate_size)
        if self.num_experts:
            split("moe_intermediate_size (features of one expert)", self.moe_intermediate_size)
        split("vocab_size", self.vocab_size)
        quant = quantization if quantization is not None else self.quantization
        if quant is not None:
            source = (
                "the checkpoint's quantization_config"
                if quant.checkpoint_quantized
                else "--quantization"
            )
            problems.append(
                f"tensor_parallel_size {tp_size} with {quant.method} quantization ({source}) "
                "is not supported: the quantized weights' scales are not split per rank; serve "
                "a quantized model with tensor_parallel_size 1, or split an unquantized one "
                "without --quantization"
            )
            block = quant.weight_block_size[0]
            sizes = (
                [("moe_intermediate_size", self.moe_intermediate_size)] if self.num_experts else []
            )
            sizes += [("intermediate_size", self.intermediate_size)] if dense else []
            for name, size in sizes:
                if size % tp_size == 0 and (size // tp_size) % block:
                    problems.append(
                        f"{name} / {tp_size} = {size // tp_size} is not a multiple of the "
                        f"quantization block {block} (weight_block_size); expert "
                        "parallelism, which would keep experts whole, is not implemented"
                    )
        if problems:
            raise ValueError(
                f"cannot split {self.architecture} over {tp_size} tensor-parallel ranks: "
                + "; ".join(problems)
            )

    @staticmethod
    def from_hf(model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` of a Hugging Face checkpoint directory.

        Reads ``rope_theta`` at the top level (Hub configs) or in ``rope_parameters``
        (transformers 5); ``head_dim`` explicit or ``hidden_size // num_attention_heads``; the
        expert count as ``num_experts`` (Hub configs) or ``num_local_experts`` (what
        transformers 5 writes).

        Raises:
            FileNotFoundError: no config.json. ValueError: unsupported model_type, rope scaling,
                dtype or quantization (:meth:`QuantizationConfig.from_hf`), or an MoE config
                without experts, with ``num_experts_per_tok`` outside ``[1, num_experts]`` or
                without ``moe_intermediate_size``.
        """
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        model_type = cfg.get("model_type")
        if model_type not in DEFAULT_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; "
                f"expected one of {sorted(DEFAULT_ARCHITECTURES)}"
            )
        architectures = cfg.get("architectures") or [DEFAULT_ARCHITECTURES[model_type]]
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        rope_scaling = RopeScaling.from_hf(
            cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        )
        heads = cfg["num_attention_heads"]
        dtype = parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        moe = _moe_fields(cfg) if model_type == "qwen3_moe" else {}
        qc = cfg.get("quantization_config")
        quantization = QuantizationConfig.from_hf(qc) if qc else None
        return ModelConfig(
            architecture=architectures[0],
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            dtype=dtype or "float32",
            rope_scaling=rope_scaling,
            quantization=quantization,
            **moe,
        )


@dataclass(frozen=True)
class RopeScaling:
    """YaRN rotary scaling (Peng, Quesnelle, Fan, Shippole, "YaRN: Efficient Context Window
    Extension of Large Language Models", 2023), with transformers' parameter names: the
    rotary frequencies are interpolated by ``factor`` below the ``beta_slow`` / ``beta_fast``
    rotation counts of the ``original_max_position_embeddings`` window, kept above, with a linear
    ramp between, and cos/sin are scaled by ``attention_factor`` (None: ``0.1 ln(factor) + 1``,
    or the ``mscale`` / ``mscale_all_dim`` ratio when both are given). Qwen3 documents factor 4
    over 32,768 positions (131,072 tokens).
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(params: dict) -> RopeScaling | None:
        """The scaling of a config's ``rope_scaling`` (or transformers 5's ``rope_parameters``);
        None for the default rotary embedding.

        Raises:
            ValueError: a rope type other than default and yarn, or a yarn entry without
                ``factor`` or ``original_max_position_embeddings``.
        """
        kind = params.get("rope_type", params.get("type", "default"))
        if kind in ("default", None):
            return None
        if kind != "yarn":
            raise ValueError(f"rope scaling {params!r} is not supported (default and yarn are)")
        try:
            factor = float(params["factor"])
            original = int(params["original_max_position_embeddings"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"yarn rope scaling needs factor and original_max_position_embeddings: {params!r}"
            ) from None

        def opt(name):
            value = params.get(name)
            return None if value is None else float(value)

        return RopeScaling(
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=opt("attention_factor"),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )


def _moe_fields(cfg: dict) -> dict:
    """The mixture-of-experts fields of a Qwen3-MoE config.json (transformers' defaults).

    Raises:
        ValueError: no experts, a top-k outside ``[1, num_experts]``, no expert size.
    """
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    top_k = int(cfg.get("num_experts_per_tok", 0) or 0)
    size = int(cfg.get("moe_intermediate_size", 0) or 0)
    if experts < 1 or not 1 <= top_k <= experts or size < 1:
        raise ValueError(
            f"a qwen3_moe config needs num_experts >= 1, 1 <= num_experts_per_tok <= "
            f"num_experts and moe_intermediate_size >= 1; got {experts}, {top_k}, {size}"
        )
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=size,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (the server's command-line flags).

    Attributes:
        model: checkpoint directory.
        dtype: weight/activation dtype name (None: float32 on CPU, the checkpoint's dtype on
            CUDA); see :func:`parse_dtype`.
        device: "cpu", "cuda" or "cuda:N".
        max_model_len: longest sequence (prompt + output) in tokens; None = the model's limit.
        block_size: tokens per KV block; None = :data:`DEFAULT_CUDA_BLOCK_SIZE` on CUDA, 16
            elsewhere. On Hopper the prefill kernel loads a K/V tile as one TMA box when a page
            holds whole tiles (``kernels.prefill_attention``, ``KV_TMA``); the prefix cache
            shares whole blocks only, so smaller blocks share shorter prefixes.
        num_kv_blocks: KV blocks to allocate; None = derive from ``kv_cache_memory_gb`` or, on
            CUDA, from free memory (``gpu_memory_utilization``).
        kv_cache_memory_gb: KV cache budget in GiB when ``num_kv_blocks`` is None.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes). 1024 keeps
            a step that mixes prompt chunks with decodes short, so running streams see steady
            inter-token latency (the budget sweep in docs/benchmarks.md, third session).
            Offline batch jobs may prefer 8192 or more.
        prefill_only_token_budget: token budget of a step in which no request decodes (a lone
            prefill takes larger chunks: fewer steps to a long prompt's first token); None =
            ``max_num_batched_tokens``. Chunked prefill only.
        lone_prompt_min_tokens: a prompt with at least this many tokens to compute past its
            prefix-cache hit, arriving at an idle engine (nothing running), is prefilled whole in
            one step of its own, up to the largest step whose activations fit the memory left after
            the KV cache and the CUDA graphs (``engine.worker.prefill_budget``; measured at
            start-up, where one step of that length runs); from 16k tokens its
            attention then runs in cuDNN (``engine.attention.dense_prefill``). Shorter prompts
            keep the chunked graph steps (an eager step's host work outweighs its GPU time
            below ~12k tokens on the H200). None = :data:`DEFAULT_LONE_PROMPT_MIN_TOKENS` on
            CUDA, off elsewhere; 0 = off. Chunked prefill only.
        max_prefill_tokens_with_decodes: most prompt tokens one step may carry while requests
            decode (long prefills then cannot stall the running streams); None or 0 = whatever
            the budget leaves (the default: at concurrency 256 a cap of 512 gives shorter TPOT
            and inter-token tails, at 64 no shorter tails, for 16-20 % less output throughput;
            docs/benchmarks.md, 2026-12-03). Chunked prefill only.
        max_prefill_attention_with_decodes: most query-key pairs of prompt attention one step
            may carry while requests decode (``engine.core.attention_budget``): a chunk over a
            long cached prefix gets fewer rows, so a long prompt's prefill adds a bounded time to
            each running stream's step at any context length. Default
            :data:`DEFAULT_MAX_PREFILL_ATTENTION_WITH_DECODES`; None or 0 = no bound. Chunked
            prefill only.
        attention_backend: "triton", "torch" or None (triton on CUDA, torch on CPU).
        enable_prefix_caching: share full KV blocks between requests with the same prefix.
        enable_chunked_prefill: split long prompts over several steps within the token budget.
        cuda_graph: run steps as CUDA graphs (CUDA with the Triton backend only): decode
            steps by batch size, prefill and mixed steps by padded token count.
        prefill_graph_max_tokens: largest prefill/mixed step captured in a graph (larger steps
            run eagerly); None = ``max_num_batched_tokens``; 0 = prefill/mixed steps eager.
        compile_mode: use of torch.compile: "model" compiles the whole forward into one graph
            with attention as a custom op, "ops" compiles only the elementwise functions one by
            one, "none" runs eagerly; None = "ops" on CUDA, "none" elsewhere (the comparison is
            in docs/benchmarks.md, second session).
        async_scheduling: schedule and launch step N+1 while step N runs on the device
            (see ``LLMEngine.step``); None = on CUDA only.
        load_format: "auto" reads the checkpoint's safetensors; "dummy" builds the model from
            ``config.json`` alone with random weights drawn on the device from ``seed``
            (benchmarks of shapes without a checkpoint; the outputs are meaningless).
        seed: seed of the random weights of ``load_format="dummy"``.
        tensor_parallel_size: ranks the model is split over (Megatron sharding, one process
            and device per rank, torch.distributed; see docs/architecture.md); 1 = one device.
        distributed_init_method: where the ranks meet: None = a free loopback port, the engine
            spawns ranks 1..N-1 on this host; ``"tcp://HOST:PORT"`` = the same at that address;
            ``"env://"`` = the ranks were launched by torchrun (``RANK``, ``WORLD_SIZE``,
            ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), possibly on several hosts.
        quantization: None serves the checkpoint as it is stored (an FP8 checkpoint in FP8);
            "fp8" also quantizes a high-precision checkpoint at load into the same 128x128
            block format (and ``load_format="dummy"`` then draws FP8 weights); see
            :func:`resolve_quantization`. Not with ``tensor_parallel_size`` > 1
            (:meth:`ModelConfig.check_tensor_parallel`).
        engine_idle_poll_ms: milliseconds an engine core in its own process keeps polling its
            pipes after its last work before it blocks (``engine.core.engine_loop.idle_polling``):
            a request arriving in that window finds the process running on a warm core instead
            of waking it. Costs one busy core meanwhile; 0 = block at once (the default). The
            in-thread core ignores it (polling there would hold the server's GIL).
    """

    model: str
    dtype: str | None = None
    device: str = "cpu"
    max_model_len: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    prefill_only_token_budget: int | None = None
    lone_prompt_min_tokens: int | None = None
    max_prefill_tokens_with_decodes: int | None = None
    max_prefill_attention_with_decodes: int | None = DEFAULT_MAX_PREFILL_ATTENTION_WITH_DECODES
    attention_backend: str | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    cuda_graph: bool = True
    prefill_graph_max_tokens: int | None = None
    compile_mode: str | None = None
    async_scheduling: bool | None = None
    load_format: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    quantization: str | None = None
    engine_idle_poll_ms: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.block_size is None:
            default = DEFAULT_CUDA_BLOCK_SIZE if self.device_type == "cuda" else 16
            object.__setattr__(self, "block_size", default)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        lone = self.lone_prompt_min_tokens
        if lone is not None and (not isinstance(lone, int) or lone < 0):
            raise ValueError(f"lone_prompt_min_tokens must be an int >= 0 (0: off), got {lone!r}")
        if not self.engine_idle_poll_ms >= 0:
            raise ValueError(
                f"engine_idle_poll_ms must be >= 0 (0: off), got {self.engine_idle_poll_ms!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        init = self.distributed_init_method
        if init is not None and not (init == "env://" or init.startswith("tcp://")):
            raise ValueError(
                f"distributed_init_method must be env:// or tcp://HOST:PORT, got {init!r}"
            )
        if self.quantization in ("none", "auto"):
            object.__setattr__(self, "quantization", None)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS} or None, "
                f"got {self.quantization!r}"
            )

    @property
    def device_type(self) -> str:
        """ "cuda" or "cpu" (the part of ``device`` before any ``:N``)."""
        return self.device.split(":", 1)[0]


def check_max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The sequence length to serve: ``config.max_model_len``, or the checkpoint's
    ``max_position_embeddings`` when unset.

    Raises:
        ValueError: ``max_model_len`` above ``max_position_embeddings`` (positions the model
            was not built for; vLLM refuses this too), naming both numbers.
    """
    limit = model.max_position_embeddings
    if config.max_model_len and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} is above the checkpoint's "
            f"max_position_embeddings {limit}: pass --max-model-len {limit} or less, or leave "
            "it unset (extending the context needs a rope_scaling entry, e.g. YaRN, in "
            "config.json and a max_position_embeddings to match)"
        )
    return config.max_model_len or limit


def resolve_quantization(model: ModelConfig, requested: str | None) -> QuantizationConfig | None:
    """The quantization a model runs with: the checkpoint's, or ``requested`` applied at load.

    * checkpoint quantized, ``requested`` None or the same method: the checkpoint's config;
    * checkpoint unquantized, ``requested`` "fp8": 128x128 block FP8 of every decoder linear
      layer, quantized at load (the embeddings, norms and LM head stay in the serving dtype);
    * neither: None.

    Raises:
        ValueError: ``requested`` differs from the checkpoint's method (a quantized checkpoint
            is never re-quantized or dequantized behind the user's back).
    """
    if model.quantization is not None:
        if requested is not None and requested != model.quantization.method:
            raise ValueError(
                f"--quantization {requested} asked for, but the checkpoint is already "
                f"quantized with {model.quantization.method}"
            )
        return model.quantization
    if requested is None:
        return None
    return QuantizationConfig(
        method=requested, modules_to_not_convert=("lm_head",), checkpoint_quantized=False
    )


@dataclass(frozen=True)
class CacheInfo:
    """Runtime facts decided when the model runner starts: KV blocks allocated, the usable
    length, the KV bytes of one block (all layers, keys and values), the model dtype name, and
    the whole-prompt steps of an idle engine: prompts of ``lone_prompt_min_tokens`` to
    ``lone_prompt_max_tokens`` tokens (``EngineConfig.lone_prompt_min_tokens`` resolved; 0 and 0
    when off; on CUDA the maximum is the largest step whose activations fit the memory left
    after the KV cache and the CUDA graphs, ``engine.worker.prefill_budget``)."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_bytes_per_block: int
    dtype: str
    lone_prompt_min_tokens: int = 0
    lone_prompt_max_tokens: int = 0


def read_generation_config(model_dir: str | Path) -> dict:
    """``generation_config.json`` of a checkpoint as a dict ({} when absent)."""
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def eos_ids_from(model_dir: str | Path) -> frozenset[int]:
    """EOS ids from ``generation_config.json`` (an int or a list; empty when absent)."""
    eos = read_generation_config(model_dir).get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])
