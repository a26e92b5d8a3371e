"""Attention kernels for the paged KV cache.

`reference` holds pure-torch implementations (the CPU backend and the test oracle);
`kv_cache`, `prefill_attention` and `decode_attention` hold the Triton kernels.
This package imports only torch and triton.
"""
