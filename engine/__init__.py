"""Batched Qwen3/Qwen2 inference engine with a paged KV cache and continuous batching."""
