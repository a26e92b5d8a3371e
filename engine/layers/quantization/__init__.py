"""Quantized linear methods: how a linear layer stores its weight, loads it and multiplies.

A :class:`~engine.layers.linear.LinearBase` built with a ``quant_config`` gets a method from
:func:`make_quant_method` (today: :class:`~engine.layers.quantization.fp8.Fp8LinearMethod`)
that creates its parameters, loads checkpoint tensors into them and runs its forward;
:func:`finalize_quantization` applies a config's ``modules_to_not_convert`` once the model is
built.
"""

from engine.layers.quantization.fp8 import (
    Fp8LinearMethod,
    finalize_quantization,
    fp8_backend,
    make_quant_method,
    quantize_fp8_blocks,
)

__all__ = [
    "Fp8LinearMethod",
    "finalize_quantization",
    "fp8_backend",
    "make_quant_method",
    "quantize_fp8_blocks",
]
