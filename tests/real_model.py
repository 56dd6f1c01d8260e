"""Engines of the real model in tests: a KV pool sized for a test's few prompts.

The default pool (`cpu_kv_cache_gib=2.0`) is zeroed as each engine starts, in every rank of a
parallel one: over a second of CPU and 2 GiB of memory each, for tests whose prompts fill a few
dozen blocks. A test about the pool's size sets its own (`num_kv_blocks`).
"""

# 364 blocks of 16 tokens in fp32, 728 in bf16.
KV_CACHE_GIB = 0.25
