"""Serve a GGUF file (llama.cpp's format) directly: ``--model path/to/model.gguf``.

The file is read with the ``gguf`` package (gguf-py, llama.cpp's own Python reader):

* **weights**: every tensor is dequantized at load (Q4_K, Q5_0, Q6_K, Q8_0, F16, BF16, F32 and
  the other types gguf-py implements) to float32 and then copied into the model's parameters
  in the serving dtype, through the same weight loaders as safetensors checkpoints (fused
  q/k/v and gate/up shards). llama.cpp's tensor names map to Hugging Face's
  (:data:`TENSOR_NAMES`); Qwen2 and Qwen3 GGUFs store q/k unpermuted, so no permutation.
* **architecture** (:func:`gguf_hf_config`): ``general.architecture`` ``qwen2`` or ``qwen3`` and
  the ``{arch}.*`` keys (block count, widths, heads, ``attention.key_length`` as Qwen3's
  head_dim, rope base, RMSNorm epsilon, context length); the LM head is tied exactly when the
  file has no ``output.weight``.
* **tokenizer** (:func:`gguf_tokenizer_json`): a ``tokenizers`` byte-level BPE from
  ``tokenizer.ggml.tokens`` / ``token_type`` / ``merges`` with Qwen2's pre-tokenizer split
  (``tokenizer.ggml.pre = "qwen2"``, also what Qwen3 GGUFs say), the Hub layout of Qwen's
  ``tokenizer.json``: the BPE vocabulary holds the NORMAL tokens, CONTROL tokens are special
  added tokens, USER_DEFINED ones non-special added tokens, UNUSED ones (``[PAD...]`` rows
  that only pad the embedding) are left out, and the NFC normalizer of Qwen's tokenizers is
  set (GGUF has no field for it; text already in NFC, e.g. ASCII, is unaffected).
* **chat template, special tokens, EOS**: ``tokenizer.chat_template``; eos/bos/pad from
  ``tokenizer.ggml.*_token_id``; generation ends at ``eos_token_id`` (transformers' only EOS
  for the same file), ``eot_token_id`` / ``eom_token_id`` when present, and the CONTROL tokens
  llama.cpp also ends at (``<|im_end|>``, ``<|endoftext|>``...: :data:`EOG_TEXTS`); sampling
  defaults only from ``general.sampling.*`` keys (none are invented).
* **refusals** (``ValueError`` naming the key, tensor or type, before any weight is read): an
  architecture other than qwen2/qwen3, rope scaling, a tensor type gguf-py cannot dequantize
  (:func:`check_tensor_types`), a tensor with no Hugging Face name, a tokenizer other than
  byte-level BPE with Qwen2's pre-tokenizer.

The engine reads configs and tokenizers from a directory, so :func:`prepare_gguf_model_dir`
writes these small derived files (config.json with ``"gguf_file"``, tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json) once into a cache folder
keyed by the file's path, size and modification time; the weights are always read from the
GGUF itself (:func:`gguf_tensors`). ``scripts/build_real_checkpoint.py`` uses the same
functions to write its safetensors directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.loader.embedded import bytes_to_unicode, default_cache_root

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
#: bump when the derived files change, so cached folders are rebuilt
CONVERTER_VERSION = 2
#: ``general.architecture`` -> (model_type, architectures entry)
ARCHITECTURES = {"qwen2": ("qwen2", "Qwen2ForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM")}
#: llama.cpp's token types (``llama_token_type``)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
#: Qwen2's pre-tokenizer split (Qwen2.5/Qwen3 ``tokenizer.json``; single digits)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {"qwen2": QWEN2_SPLIT}

#: llama.cpp tensor names -> Hugging Face's (``N`` = layer); ``.weight``/``.bias`` kept
TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file (a regular file starting with the magic ``GGUF``)."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def _reader(path: str | Path):
    """A ``gguf.GGUFReader`` of ``path`` (memory-mapped; tensor data is read lazily).

    Raises:
        ImportError: the ``gguf`` package is missing (a main dependency; named with the fix).
    """
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - a main dependency of the project
        raise ImportError(
            f"reading the GGUF file {path} needs the `gguf` package (llama.cpp's gguf-py), a "
            "dependency of this project: `pip install 'gguf>=0.10'` or reinstall the project"
        ) from exc
    return GGUFReader(str(path))


def _can_dequantize(type_name: str) -> bool:
    """Whether gguf-py dequantizes tensors of ggml type ``type_name`` (probed on one zero
    block, since gguf-py raises NotImplementedError only when called)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    if qtype not in GGML_QUANT_SIZES:
        return False
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


def check_tensor_types(meta: dict[str, Any]) -> None:
    """Refuse, before any weight is read, a GGUF with a tensor gguf-py cannot dequantize.

    Args:
        meta: :func:`read_gguf_metadata` of the file.

    Raises:
        ValueError: naming the first such tensor, its type, and every type of the file that
            cannot be dequantized (e.g. ``Q8_1``, ``Q8_K``, integer or float64 tensors).
    """
    types = {ty for ty, _ in meta["__tensors__"].values()}
    bad = sorted(ty for ty in types if not _can_dequantize(ty))
    if bad:
        name = next(n for n, (ty, _) in meta["__tensors__"].items() if ty in bad)
        raise ValueError(
            f"GGUF tensor {name} has type {meta['__tensors__'][name][0]}, which gguf-py cannot "
            f"dequantize (unsupported tensor types in this file: {', '.join(bad)})"
        )


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file -> its value (strings, numbers, lists), plus
    ``"__tensors__"``: name -> (ggml type name, shape in PyTorch order)."""
    reader = _reader(path)
    meta: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
    meta["__tensors__"] = {
        t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)))
        for t in reader.tensors
    }
    return meta


def gguf_hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config.json of a Qwen2/Qwen3 GGUF.

    Raises:
        ValueError: another architecture, rope scaling, or missing keys (named).
    """
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; expected one of {sorted(ARCHITECTURES)}"
        )
    model_type, architecture = ARCHITECTURES[arch]

    def key(name: str, default: Any = KeyError) -> Any:
        full = f"{arch}.{name}"
        if full in meta:
            return meta[full]
        if default is KeyError:
            raise ValueError(f"GGUF metadata lacks {full}")
        return default

    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    tensors = meta["__tensors__"]
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight")
    vocab, hidden = tensors["token_embd.weight"][1]
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    # float32 scalars (1e-6 arrives as 9.99999997e-07): the shortest decimal that rounds back
    eps = float(str(np.float32(key("attention.layer_norm_rms_epsilon"))))
    tied = "output.weight" not in tensors
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        # the serving dtype on CUDA (the CPU serves float32); ``--dtype`` overrides
        "torch_dtype": "bfloat16",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if model_type == "qwen2":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    return cfg


def _spelled(token: str, alphabet: set[str], spelling: dict[int, str]) -> str:
    """A token in GPT-2's byte alphabet (byte-level GGUFs already store them so)."""
    if set(token) <= alphabet:
        return token
    return "".join(spelling[b] for b in token.encode("utf-8"))


def gguf_tokenizer_json(meta: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer.json`` (as a dict) of the GGUF's byte-level BPE, in the Hub layout of Qwen's.

    Raises:
        ValueError: a tokenizer model other than ``gpt2`` (byte-level BPE), a pre-tokenizer
            other than ``qwen2``, NORMAL tokens that are not ids ``0..n-1``, or a merge that
            uses a token outside the BPE vocabulary.
    """
    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (byte-level gpt2 only)")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; expected one of {sorted(PRE_TOKENIZERS)}"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        _spelled(t, alphabet, spelling): i
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty == NORMAL
    }
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError("GGUF NORMAL tokens are not the ids 0..n-1 (or two share a spelling)")
    merges = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        a, b = m.split(" ", 1)
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise ValueError(f"GGUF merge {m!r} uses a token outside the BPE vocabulary")
        merges.append([a, b])
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": ty == CONTROL,
        }
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in (CONTROL, USER_DEFINED)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PRE_TOKENIZERS[pre]},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {},
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
            "merges": merges,
        },
    }


_ADDED_TOKEN_KEYS = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")


def gguf_tokenizer_config(meta: dict[str, Any], tokenizer_json: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: chat template, eos/pad/bos token texts from the GGUF ids.

    Raises:
        ValueError: no ``tokenizer.chat_template``.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    template = meta.get("tokenizer.chat_template")
    if not template:
        raise ValueError("GGUF has no tokenizer.chat_template")

    def text(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    added = tokenizer_json["added_tokens"]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    return {
        "add_bos_token": add_bos,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in _ADDED_TOKEN_KEYS} for a in added},
        "additional_special_tokens": [
            a["content"]
            for a in added
            if a["special"] and a["id"] != meta.get("tokenizer.ggml.bos_token_id")
        ],
        "bos_token": text("bos_token_id") if add_bos else None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": text("eos_token_id"),
        "errors": "replace",
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 32768)),
        "pad_token": text("padding_token_id"),
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


#: GGUF ``general.sampling.*`` keys -> generation_config names
SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


#: texts llama.cpp also treats as end of generation when they are CONTROL tokens
#: (``llama_vocab::load``: its end-of-generation set beyond the eos/eot/eom ids)
EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def gguf_generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``generation_config.json`` of a GGUF.

    Returns:
        dict with ``eos_token_id``: the file's ``eos_token_id`` first, then
        ``eot_token_id``/``eom_token_id`` when present, then the CONTROL tokens whose text
        llama.cpp also ends generation at (:data:`EOG_TEXTS`; for Qwen's GGUFs
        ``<|im_end|>`` 151645 and ``<|endoftext|>`` 151643, the EOS list of the Hub's
        generation configs); ``bos_token_id``/``pad_token_id`` when the file has them;
        sampling defaults only from ``general.sampling.*`` (none invented).
    """
    eos = [
        meta[f"tokenizer.ggml.{k}"]
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if meta.get(f"tokenizer.ggml.{k}") is not None
    ]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    eos += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in EOG_TEXTS]
    gen: dict[str, Any] = {"eos_token_id": list(dict.fromkeys(int(i) for i in eos))}
    for k, name in (("bos_token_id", "bos_token_id"), ("padding_token_id", "pad_token_id")):
        if meta.get(f"tokenizer.ggml.{k}") is not None:
            gen[name] = int(meta[f"tokenizer.ggml.{k}"])
    for k, name in SAMPLING_KEYS.items():
        if f"general.sampling.{k}" in meta:
            gen[name] = meta[f"general.sampling.{k}"]
    return gen


def hf_tensor_name(name: str) -> str:
    """llama.cpp tensor name -> Hugging Face's (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``).

    Raises:
        ValueError: a tensor this mapping does not know (named).
    """
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{TENSOR_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TENSOR_NAMES and not parts[0].startswith(("attn", "ffn")):
        return f"{TENSOR_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {name} has no Qwen2/Qwen3 counterpart")


def gguf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) of every tensor of the file, one at a time,
    dequantized by gguf-py (``gguf.quants.dequantize``).

    Raises:
        ValueError: a tensor type gguf-py cannot dequantize, or an unknown tensor name (named).
    """
    import torch  # here: the server's front end reads GGUF metadata without loading torch
    from gguf.quants import dequantize

    for t in _reader(path).tensors:
        name = hf_tensor_name(t.name)
        try:
            data = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, KeyError, ValueError) as exc:
            raise ValueError(
                f"GGUF tensor {t.name} has type {t.tensor_type.name}, which cannot be "
                f"dequantized here ({exc})"
            ) from None
        shape = tuple(int(d) for d in reversed(t.shape))
        # a copy: F32 tensors are read-only views of the memory-mapped file
        yield name, torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)


def write_gguf_files(gguf_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write config.json (with ``"gguf_file"``), tokenizer.json, tokenizer_config.json,
    chat_template.jinja and generation_config.json of a GGUF into ``out_dir``.

    Returns:
        the metadata (:func:`read_gguf_metadata`).

    Raises:
        ValueError: an architecture other than qwen2/qwen3, a tensor type gguf-py cannot
            dequantize, a tensor name with no Hugging Face counterpart, or what the tokenizer
            builders raise (each names the key, tensor or type).
    """
    from tokenizers import Tokenizer

    out = Path(out_dir)
    meta = read_gguf_metadata(gguf_path)
    cfg = gguf_hf_config(meta)
    check_tensor_types(meta)
    for name in meta["__tensors__"]:
        hf_tensor_name(name)  # ValueError naming a tensor the model would not load
    cfg["gguf_file"] = str(Path(gguf_path).resolve())
    tj = gguf_tokenizer_json(meta)
    tok_cfg = gguf_tokenizer_config(meta, tj)
    text = json.dumps(tj, ensure_ascii=False, indent=2) + "\n"
    Tokenizer.from_str(text)  # fail here, not in the server, on a tokenizer tokenizers refuses
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok_cfg, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )
    (out / "chat_template.jinja").write_text(tok_cfg["chat_template"], encoding="utf-8")
    (out / "generation_config.json").write_text(
        json.dumps(gguf_generation_config(meta), indent=2) + "\n"
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return meta


def gguf_file_of(model_dir: str | Path) -> Path | None:
    """The GGUF a prepared model directory serves (its config.json's ``gguf_file``), or None."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    path = json.loads(cfg.read_text()).get("gguf_file")
    return Path(path) if path else None


def prepare_gguf_model_dir(gguf_path: str | Path, cache_root: str | Path | None = None) -> Path:
    """The model directory serving ``gguf_path``, written on first use.

    It lives in ``cache_root / "gguf" / "<stem>-<fingerprint>"`` (default cache root:
    ``$QWEN_SERVE_CACHE`` or ``~/.cache/qwen-serve``); the fingerprint hashes the resolved path,
    size, modification time and :data:`CONVERTER_VERSION`, so an edited file gets a new folder.
    Written in a temporary folder renamed into place (a concurrent start sees a whole one).

    Raises:
        FileNotFoundError: not a GGUF file. ValueError: unsupported architecture or tokenizer.
    """
    src = Path(gguf_path).resolve()
    if not is_gguf(src):
        raise FileNotFoundError(f"{gguf_path} is not a GGUF file")
    st = src.stat()
    key = f"{src}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    final = root / "gguf" / f"{src.stem}-{fingerprint}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write_gguf_files(src, tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model_path(model: str | Path) -> str:
    """``model`` as the engine reads it: a GGUF file -> its prepared directory
    (:func:`prepare_gguf_model_dir`); anything else unchanged."""
    return str(prepare_gguf_model_dir(model)) if is_gguf(model) else str(model)
