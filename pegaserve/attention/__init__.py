"""Attention over the paged KV cache, behind a backend interface."""
