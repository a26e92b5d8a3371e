"""Weights into models: safetensors checkpoints, random weights, the embedded checkpoint builder."""
