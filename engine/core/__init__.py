"""The engine core: requests, scheduler, KV cache manager, outputs and stats. Pure Python
(no torch)."""
