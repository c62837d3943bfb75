"""Dataset preparation (`prepare`), shard files (`shards`), tokenizers and the distributed
loader."""
