"""DeepSeek-V4 model in pure PyTorch: config, layers, caches, engine."""

from .config import ModelConfig
from .model import Transformer

__all__ = ["ModelConfig", "Transformer", "Engine"]


def __getattr__(name):
    # engine pulls in the loader (safetensors etc.); import it on first use only
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)
