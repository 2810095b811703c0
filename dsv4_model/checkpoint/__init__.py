"""Checkpoints: shard I/O, the layouts' names, loading (validation first), writing, tokenizers. Depends on
dsv4_model.model.transformer and dsv4_model.quant."""
