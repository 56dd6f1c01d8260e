"""Model definitions over the paged KV cache."""
