"""Attention: step metadata, the backend protocol, torch and Triton backends, the custom op."""
