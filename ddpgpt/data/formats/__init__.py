"""prepare's input formats: one module per format (text, jsonl, parquet, llm.c shards, hf:
datasets), each a `base.Format`, and `table.FORMATS`, the one table of them that prepare reads."""
