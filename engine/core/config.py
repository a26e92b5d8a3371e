"""Frozen configuration objects: the model (read from a Hugging Face config.json) and the engine.

Pure Python: dtypes are names ("float32", "bfloat16", "float16"); the worker maps them to torch
dtypes (``engine.worker.device.torch_dtype``). Runtime facts such as the number of KV blocks
that fit in memory are not stored here; the model runner returns them in :class:`CacheInfo`.
"""

from __future__ import annotations

import json
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
DEFAULT_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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
    """Architecture of a Qwen3 (``model_type="qwen3"``) or Qwen2 (``"qwen2"``) decoder.

    Qwen3 has per-head RMSNorm on q and k (``qk_norm``) and no q/k/v bias; Qwen2 has q/k/v bias
    and no q/k norm. ``architecture`` is the first ``architectures`` entry of config.json (the
    key of the model registry, ``engine.models.registry``); ``dtype`` the checkpoint's dtype name.
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

    @staticmethod
    def from_hf(model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` of a Hugging Face checkpoint directory.

        Reads ``rope_theta`` at the top level (Hub configs) or in ``rope_parameters``
        (transformers 5); ``head_dim`` explicit or ``hidden_size // num_attention_heads``.

        Raises:
            FileNotFoundError: no config.json. ValueError: unsupported model_type, rope scaling
                or dtype.
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
        rope_scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) not in (
            "default",
            None,
        ):
            raise ValueError(f"rope scaling {rope_scaling!r} is not supported")
        heads = cfg["num_attention_heads"]
        dtype = parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
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
            qk_norm=model_type == "qwen3",
            dtype=dtype or "float32",
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
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks to allocate; None = derive from ``kv_cache_memory_gb`` or, on
            CUDA, from free memory (``gpu_memory_utilization``).
        kv_cache_memory_gb: KV cache budget in GiB when ``num_kv_blocks`` is None.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes). 1024 keeps
            a step that mixes prompt chunks with decodes short, so running streams see steady
            inter-token latency (the budget sweep in docs/benchmarks.md, third session).
            Offline batch jobs may prefer 8192 or more.
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
        seed: seed of the random weights of benchmark mode.
    """

    model: str
    dtype: str | None = None
    device: str = "cpu"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    attention_backend: str | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    cuda_graph: bool = True
    prefill_graph_max_tokens: int | None = None
    compile_mode: str | None = None
    async_scheduling: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    @property
    def device_type(self) -> str:
        """ "cuda" or "cpu" (the part of ``device`` before any ``:N``)."""
        return self.device.split(":", 1)[0]


@dataclass(frozen=True)
class CacheInfo:
    """Runtime facts decided when the model runner starts: KV blocks allocated, the usable
    length, the KV bytes of one block (all layers, keys and values) and the model dtype name."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_bytes_per_block: int
    dtype: str


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
