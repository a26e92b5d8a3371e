"""Command-line flags and their QWEN_SERVE_* environment defaults."""

from __future__ import annotations

import pytest

from server.__main__ import build_parser


def test_env_default_is_used(monkeypatch):
    monkeypatch.setenv("QWEN_SERVE_ASYNC_SCHEDULING", "off")
    monkeypatch.setenv("QWEN_SERVE_PORT", "9123")
    args = build_parser().parse_args([])
    assert args.async_scheduling == "off" and int(args.port) == 9123


@pytest.mark.parametrize(
    "name,value", [("ASYNC_SCHEDULING", "true"), ("ENGINE_MODE", "fast"), ("DTYPE", "fp8")]
)
def test_env_value_outside_the_choices_is_a_clear_error(monkeypatch, capsys, name, value):
    monkeypatch.setenv(f"QWEN_SERVE_{name}", value)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"QWEN_SERVE_{name}" in err and repr(value) in err


@pytest.mark.parametrize(
    "value,expected",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
        ("", False),
    ],
)
def test_switches_read_true_and_false_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("QWEN_SERVE_NO_PREFIX_CACHING", value)
    assert build_parser().parse_args([]).no_prefix_caching is expected
    assert build_parser().parse_args(["--no-prefix-caching"]).no_prefix_caching is True


@pytest.mark.parametrize(
    "env,value,fragment",
    [
        ("NO_PREFIX_CACHING", "maybe", "invalid switch value"),
        ("PORT", "abc", "invalid int value"),
        ("PORT", "99999", "out of range"),
        ("MAX_MODEL_LEN", "-5", "out of range"),
        ("GPU_MEMORY_UTILIZATION", "1.5", "out of range"),
        ("ENGINE_IDLE_POLL_MS", "-1", "out of range"),
        ("ENGINE_IDLE_POLL_MS", "inf", "finite"),
        ("ENGINE_IDLE_POLL_MS", "nan", "finite"),
        ("GRACEFUL_TIMEOUT", "inf", "finite"),
        ("DEVICE", "gpu", "invalid device"),
        ("MODEL", "Qwen/Qwen3-0.6B", "not a local directory"),
    ],
)
def test_bad_environment_values_are_one_line_errors_naming_the_variable(
    monkeypatch, capsys, env, value, fragment
):
    monkeypatch.setenv(f"QWEN_SERVE_{env}", value)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and f"QWEN_SERVE_{env}" in err and "Traceback" not in err


def test_log_level_is_case_insensitive_and_help_has_no_empty_defaults(monkeypatch, capsys):
    monkeypatch.setenv("QWEN_SERVE_LOG_LEVEL", "INFO")
    assert build_parser().parse_args([]).log_level == "info"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "(default: None)" not in capsys.readouterr().out


def test_quantization_flag_reaches_the_engine_config(monkeypatch):
    """``--quantization fp8`` (or QWEN_SERVE_QUANTIZATION) is the EngineConfig's; auto is None."""
    from engine.core.config import EngineConfig

    assert build_parser().parse_args([]).quantization == "auto"
    assert EngineConfig(model="m", quantization="auto").quantization is None
    monkeypatch.setenv("QWEN_SERVE_QUANTIZATION", "fp8")
    args = build_parser().parse_args([])
    assert EngineConfig(model="m", quantization=args.quantization).quantization == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "awq"])


def test_model_may_be_a_gguf_file_but_not_another_file(tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert build_parser().parse_args(["--model", str(gguf)]).model == str(gguf)
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"{}")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", str(other)])
    assert "is a file but not a GGUF file" in capsys.readouterr().err


def test_prompt_attention_bound_reaches_the_engine_config(monkeypatch, capsys):
    """``--max-prefill-attention-with-decodes``: the engine's default unless given, 0 turns the
    bound off (None in the EngineConfig), a negative value is refused naming the flag."""
    from engine.core.config import DEFAULT_MAX_PREFILL_ATTENTION_WITH_DECODES
    from server.factory import engine_config

    def config(argv):
        args = build_parser().parse_args(["--device", "cpu", *argv])
        return engine_config(args).max_prefill_attention_with_decodes

    assert config([]) == DEFAULT_MAX_PREFILL_ATTENTION_WITH_DECODES
    assert config(["--max-prefill-attention-with-decodes", "0"]) is None
    assert config(["--max-prefill-attention-with-decodes", "4096"]) == 4096
    monkeypatch.setenv("QWEN_SERVE_MAX_PREFILL_ATTENTION_WITH_DECODES", "0")
    assert config([]) is None
    monkeypatch.setenv("QWEN_SERVE_MAX_PREFILL_ATTENTION_WITH_DECODES", "-1")
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "QWEN_SERVE_MAX_PREFILL_ATTENTION_WITH_DECODES" in err and "out of range" in err


def test_prompt_token_cap_is_off_unless_given_and_zero_means_off(monkeypatch, capsys):
    """``--max-prefill-tokens-with-decodes``: no cap unless given (as ``EngineConfig``), 0 is
    no cap (None), a value reaches the engine config, a negative value names the flag."""
    from engine.core.config import EngineConfig
    from server.factory import engine_config

    def config(argv):
        args = build_parser().parse_args(["--device", "cpu", *argv])
        return engine_config(args).max_prefill_tokens_with_decodes

    assert config([]) is None
    assert EngineConfig(model="m").max_prefill_tokens_with_decodes is None
    assert config(["--max-prefill-tokens-with-decodes", "0"]) is None
    assert config(["--max-prefill-tokens-with-decodes", "768"]) == 768
    monkeypatch.setenv("QWEN_SERVE_MAX_PREFILL_TOKENS_WITH_DECODES", "256")
    assert config([]) == 256
    monkeypatch.setenv("QWEN_SERVE_MAX_PREFILL_TOKENS_WITH_DECODES", "-1")
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "QWEN_SERVE_MAX_PREFILL_TOKENS_WITH_DECODES" in err and "out of range" in err


def test_a_bad_flag_is_one_line_on_stderr(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--max-num-seqs", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-num-seqs" in err and "out of range" in err


def test_block_size_defaults_by_device(monkeypatch, capsys):
    """Unset, --block-size is the engine's device default: 128-token blocks on CUDA (whole
    tiles of the prefill kernel's TMA loads), 16 on the CPU; a value is kept; 0 is refused."""
    from engine.core.config import DEFAULT_CUDA_BLOCK_SIZE, EngineConfig

    args = build_parser().parse_args([])
    assert args.block_size is None
    assert EngineConfig(model="m", device="cuda", block_size=args.block_size).block_size == 128
    assert DEFAULT_CUDA_BLOCK_SIZE == 128
    assert EngineConfig(model="m", device="cuda:1").block_size == 128
    assert EngineConfig(model="m", device="cpu").block_size == 16
    monkeypatch.setenv("QWEN_SERVE_BLOCK_SIZE", "32")
    assert (
        EngineConfig(
            model="m", device="cuda", block_size=build_parser().parse_args([]).block_size
        ).block_size
        == 32
    )
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="m", block_size=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--block-size", "0"])
    assert "--block-size" in capsys.readouterr().err


def test_cuda_and_triton_flags_refused_where_they_cannot_run(monkeypatch, capsys):
    """--device cuda without a CUDA device, and --attention-backend triton on the CPU without
    the interpreter, are start-up errors naming the flag (they used to start and then fail
    every request with a 500, or end in a traceback)."""
    import server.__main__ as cli

    monkeypatch.setattr(cli, "_cuda_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for argv, flag in (
        (["--device", "cuda"], "--device"),
        (["--device", "cuda:1"], "--device"),
        (["--device", "cpu", "--attention-backend", "triton"], "--attention-backend"),
        (["--attention-backend", "triton"], "--attention-backend"),  # auto resolves to the CPU
    ):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 2
        assert f"argument {flag}" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter: allowed (tests)
    assert build_parser().parse_args(["--attention-backend", "triton"]).attention_backend
    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert build_parser().parse_args(["--device", "cuda", "--attention-backend", "triton"])


def test_misspelt_env_variables_are_reported():
    """QWEN_SERVE_* names that no flag or switch reads are listed (main() logs a warning)."""
    from server.__main__ import unknown_env

    env = {
        "QWEN_SERVE_BLOK_SIZE": "99",
        "QWEN_SERVE_BLOCK_SIZE": "16",
        "QWEN_SERVE_PDL": "0",
        "QWEN_SERVE_CACHE": "/tmp/x",
        "QWEN_SERVE_NO_PREFIX_CACHING": "1",
        "OTHER": "1",
    }
    assert unknown_env(build_parser(), env) == ["QWEN_SERVE_BLOK_SIZE"]
    from kernels.switches import COUNT_NAMES, SWITCH_NAMES, env_switch

    assert unknown_env(build_parser(), dict.fromkeys(SWITCH_NAMES + COUNT_NAMES, "1")) == []
    with pytest.raises(ValueError, match="not a registered switch"):
        env_switch("QWEN_SERVE_NOT_A_SWITCH")


def test_a_bad_switch_value_stops_the_start_up(monkeypatch, capsys):
    """Every kernel switch's value is read at start-up, also where its kernel never runs (the
    CPU): a value that is not on/off is a start-up error naming the variable."""
    from server.__main__ import bad_switches, main

    assert bad_switches({"QWEN_SERVE_PDL": "0", "QWEN_SERVE_DENSE_PREFILL": "on"}) == []
    problems = bad_switches({"QWEN_SERVE_DECODE_FUSED_REDUCE": "maybe", "QWEN_SERVE_PDL": "1"})
    assert len(problems) == 1 and "QWEN_SERVE_DECODE_FUSED_REDUCE" in problems[0]
    assert bad_switches({"QWEN_SERVE_DECODE_MAX_SPLITS": "8"}) == []
    for bad in ("0", "eight"):  # the integer knobs too
        problems = bad_switches({"QWEN_SERVE_DECODE_MAX_SPLITS": bad})
        assert len(problems) == 1 and "QWEN_SERVE_DECODE_MAX_SPLITS" in problems[0]
    monkeypatch.setenv("QWEN_SERVE_DECODE_FUSED_QK_ROPE", "sometimes")
    with pytest.raises(SystemExit) as exc:
        main(["--port", "0"])
    assert exc.value.code == 2
    assert "QWEN_SERVE_DECODE_FUSED_QK_ROPE='sometimes'" in capsys.readouterr().err


def _start_up_error(capsys, *flags: str) -> str:
    """What ``python -m server FLAGS`` writes when it refuses to start: exit code 2, one line,
    no traceback."""
    from server.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main([*flags, "--port", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_max_model_len_above_the_checkpoint_is_refused_before_start_up(capsys):
    """vLLM's rule: a --max-model-len above max_position_embeddings (4096 for the embedded
    model) stops the server with one line naming both numbers (it used to warn and clamp)."""
    err = _start_up_error(capsys, "--max-model-len", "4097")
    assert "max_model_len 4097" in err and "max_position_embeddings 4096" in err


def test_engine_refuses_max_model_len_above_the_checkpoint():
    from engine.core.config import EngineConfig, ModelConfig, check_max_model_len
    from engine.loader.embedded import ensure_embedded_checkpoint

    ckpt = str(ensure_embedded_checkpoint())
    model = ModelConfig.from_hf(ckpt)
    assert check_max_model_len(EngineConfig(model=ckpt), model) == 4096
    assert check_max_model_len(EngineConfig(model=ckpt, max_model_len=4096), model) == 4096
    assert check_max_model_len(EngineConfig(model=ckpt, max_model_len=100), model) == 100
    with pytest.raises(ValueError, match="above the checkpoint's max_position_embeddings 4096"):
        check_max_model_len(EngineConfig(model=ckpt, max_model_len=8192), model)


def test_tensor_parallel_size_the_checkpoint_cannot_split_is_one_line(capsys):
    """--tensor-parallel-size 3 over the embedded model (4 heads): the engine's own message as a
    parser error before any process starts, not the engine process's traceback."""
    err = _start_up_error(capsys, "--tensor-parallel-size", "3")
    assert "cannot split" in err and "over 3 tensor-parallel ranks" in err


def test_idle_polling_with_the_thread_core_is_refused(capsys):
    """--engine-idle-poll-ms polls the engine process's pipes: with the in-thread engine (the
    CPU default, or --engine-mode thread) the server refuses to start, and the launcher
    refuses the pair too."""
    from engine.core.config import EngineConfig
    from engine.frontend import launch
    from engine.loader.embedded import ensure_embedded_checkpoint

    for flags in ((), ("--engine-mode", "thread")):
        err = _start_up_error(capsys, "--engine-idle-poll-ms", "5", *flags)
        assert "--engine-idle-poll-ms" in err and "5 needs the engine core in its own" in err
    config = EngineConfig(model=str(ensure_embedded_checkpoint()), engine_idle_poll_ms=5)
    with pytest.raises(ValueError, match="not to the in-thread engine"):
        launch.start_engine_core(config, frozenset(), "thread")


@pytest.mark.parametrize(
    "flags,said",
    [
        (("--tensor-parallel-size", "0"), "--tensor-parallel-size (or QWEN_SERVE_TENSOR_PARALLEL"),
        (("--distributed-init-method", "foo://bar"), "must be env:// or tcp://HOST:PORT"),
        (("--api-key", ""), "argument --api-key (or QWEN_SERVE_API_KEY): empty"),
        (("--api-key", "key\n"), "with leading or trailing whitespace"),
        (("--kv-cache-memory-gb", "1e9", "--device", "cpu"), "more than this machine's memory"),
    ],
    ids=["tp-0", "init-method", "empty-api-key", "api-key-newline", "kv-budget-over-ram"],
)
def test_start_up_errors_are_one_line(capsys, flags, said):
    """What a new-user trial found as tracebacks (or, for an empty --api-key, a key that
    accepted an empty bearer token): each a one-line error before start-up."""
    assert said in _start_up_error(capsys, *flags)


def test_a_directory_that_is_not_a_checkpoint_is_one_line(capsys, tmp_path):
    """--model naming a directory without config.json, or with one that is not JSON, not an
    object, or without a key the architecture needs: one line naming --model (tracebacks
    before: FileNotFoundError, JSONDecodeError, AttributeError, KeyError)."""
    assert "has no config.json" in _start_up_error(capsys, "--model", str(tmp_path))
    for text, said in (
        ("{bad", "config.json is not UTF-8 JSON"),
        ("[]", "not a usable model config (not a JSON object of settings)"),
        ('{"model_type": "qwen3"}', "not a usable model config (no 'num_attention_heads')"),
    ):
        (tmp_path / "config.json").write_text(text)
        err = _start_up_error(capsys, "--model", str(tmp_path), "--device", "cpu")
        assert "--model" in err and said in err, err


def test_quantizing_a_moe_checkpoint_is_refused_before_start_up(capsys, tiny_moe_checkpoint):
    """--quantization fp8 of a Qwen3-MoE checkpoint: the model's own refusal, as one line
    before any process starts (a traceback from the model's construction before)."""
    from engine.core.config import ModelConfig, resolve_quantization

    path, _ = tiny_moe_checkpoint
    err = _start_up_error(capsys, "--model", path, "--quantization", "fp8")
    assert "fp8 quantization of Qwen3-MoE is not supported" in err
    model = ModelConfig.from_hf(path)
    model.check_quantization(None)  # unquantized: served
    with pytest.raises(ValueError, match="Qwen3-MoE is not supported"):
        model.check_quantization(resolve_quantization(model, "fp8"))
