"""Running the model: the engine, the decode runner (compile, CUDA graphs), sampling, generation, the CLI."""
