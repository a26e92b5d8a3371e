"""Attention backends by name, created on first use with lazy imports (no import cycle).

The ``qwen_serve::paged_attention`` custom op (:mod:`engine.attention.custom_op`) receives only
a backend's *name* (a custom op cannot take a Python object), so this module is the one place
that maps a name to an instance. Sharing one instance per name is safe: the torch backend is
stateless and the Triton backend's state is its decode scratch, reused by every layer and step
already (one engine per process; two engines on concurrent CUDA streams in one process would
share that scratch). The registry pattern follows mini-sglang's ``minisgl/attention``.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.attention.backend import AttentionBackend


def _torch() -> AttentionBackend:
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _triton() -> AttentionBackend:
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


#: backend name -> creator (imports the backend's module when first called)
BACKEND_CREATORS: dict[str, Callable[[], AttentionBackend]] = {"torch": _torch, "triton": _triton}

_INSTANCES: dict[str, AttentionBackend] = {}


def default_backend_name(device_type: str) -> str:
    """ "triton" on CUDA, "torch" elsewhere."""
    return "triton" if device_type == "cuda" else "torch"


def get_attention_backend(name: str) -> AttentionBackend:
    """The process-wide backend instance of ``name``, created on first use.

    Raises:
        ValueError: unknown name.
    """
    backend = _INSTANCES.get(name)
    if backend is None:
        creator = BACKEND_CREATORS.get(name)
        if creator is None:
            raise ValueError(
                f"unknown attention backend {name!r}; expected one of {sorted(BACKEND_CREATORS)}"
            )
        backend = _INSTANCES[name] = creator()
    return backend
