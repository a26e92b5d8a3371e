"""Model classes by the ``architectures`` entry of config.json, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

#: architecture -> (module, class)
MODELS: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def model_class(architecture: str) -> type[nn.Module]:
    """The engine's class for a Hugging Face architecture name.

    Raises:
        ValueError: an architecture the engine does not serve.
    """
    entry = MODELS.get(architecture)
    if entry is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODELS)}")
    module, cls = entry
    return getattr(importlib.import_module(module), cls)
