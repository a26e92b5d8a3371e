"""Model definitions (Qwen3 and Qwen2 decoders over the paged KV cache)."""
