"""The paged KV cache: the block pool, block tables with the prefix cache, the cache's files."""
