"""DeepSeek-V4 model in pure PyTorch: config, layers, caches, engine."""

from .config import ModelConfig

__all__ = ["ModelConfig", "Transformer", "Engine"]


def __getattr__(name):
    # the model loads the op library and the engine the loader (safetensors etc.): import them on first use, so
    # light modules (config, cli argument parsing) need neither
    if name == "Transformer":
        from .model import Transformer

        return Transformer
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)
