"""The model in pure PyTorch: config, layers, attention (compressor, indexer), MoE, the Transformer and its
decode step. Depends on nothing else in dsv4_model."""
