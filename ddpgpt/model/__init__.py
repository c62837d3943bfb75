"""The single-device decoder. It knows nothing of processes: parallelism is applied from the
outside (`sync/ddp.py`'s wrap_model).

    gpt.py        the skeleton: embedding, blocks, head, init, loss, FLOPs
    attention.py  causal self-attention and the KV cache
    layers.py     the pieces: norms, rotary positions, MLPs
    generate.py   sampling, the context window past block_size
"""
