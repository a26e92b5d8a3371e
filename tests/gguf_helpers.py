"""Write tiny GGUF files for the tests with gguf-py's ``GGUFWriter`` (llama.cpp's own writer),
independently of the engine's reader: the tensor names and metadata keys are spelled out here
as llama.cpp's ``convert_hf_to_gguf.py`` writes them for Qwen2/Qwen3."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

#: a ChatML template (what Qwen's GGUFs carry, shortened)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: merges of the tiny byte-level BPE (GPT-2 byte alphabet: "Ġ" is a space)
MERGES = [
    ("T", "h"),
    ("Th", "e"),
    ("Ġ", "t"),
    ("Ġt", "h"),
    ("Ġth", "e"),
    ("a", "t"),
    ("Ġ", "c"),
    ("Ġc", "at"),
]

#: Hugging Face module name -> llama.cpp's (per layer)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, llama.cpp token types, merges) of a byte-level BPE padded to ``vocab_size``:
    256 byte tokens and the merge results (NORMAL, 1), the ChatML specials (CONTROL, 3), then
    ``[PAD<i>]`` rows (UNUSED, 5), the layout of Qwen's GGUFs."""
    tokens = _byte_alphabet() + ["".join(m) for m in MERGES]
    types = [1] * len(tokens)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def gguf_name(hf_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``."""
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    return top[hf_name]


def write_tiny_gguf(path: str | Path, model, arch: str, qtype_name: str = "F32") -> Path:
    """Write a transformers Qwen2/Qwen3 model as a GGUF file.

    Args:
        path: the file to write.
        model: a float32 ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` (tied head: no
            ``output.weight``, as llama.cpp writes it).
        arch: ``"qwen2"`` or ``"qwen3"`` (``general.architecture``).
        qtype_name: ggml type of the 2-D weights (``F32``, ``F16``, ``BF16``, ``Q8_0``,
            ``Q4_0``, ``Q5_0``...; quantized with ``gguf.quants.quantize``), or ``Q8_1`` to
            write an (empty) tensor type gguf-py cannot dequantize. Norms and biases stay F32.

    Returns:
        ``path``.
    """
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    tokens, types, merges = tiny_vocab(cfg.vocab_size)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name("tiny-" + arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    tied = bool(cfg.tie_word_embeddings)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        data = t.detach().to(torch.float32).cpu().numpy()
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), data.astype(np.float16))
        elif qtype_name == "Q8_1":  # no gguf-py quantizer: the bytes of a zero tensor
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
