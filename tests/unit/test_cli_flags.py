"""Command-line flags and their QWEN_SERVE_* environment defaults."""

from __future__ import annotations

import pytest

from server.__main__ import build_parser


def test_env_default_is_used(monkeypatch):
    monkeypatch.setenv("QWEN_SERVE_ASYNC_SCHEDULING", "off")
    monkeypatch.setenv("QWEN_SERVE_PORT", "9123")
    args = build_parser().parse_args([])
    assert args.async_scheduling == "off" and int(args.port) == 9123


@pytest.mark.parametrize("name,value", [("ASYNC_SCHEDULING", "true"), ("ENGINE_MODE", "fast"), ("DTYPE", "fp8")])
def test_env_value_outside_the_choices_is_a_clear_error(monkeypatch, capsys, name, value):
    monkeypatch.setenv(f"QWEN_SERVE_{name}", value)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"QWEN_SERVE_{name}" in err and repr(value) in err
