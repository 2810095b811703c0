"""DeepSeek-V4 model in pure PyTorch: config, layers, caches, engine."""

from dsv4_model.checkpoint.builtin import DEFAULT_MODEL
from dsv4_model.model.config import ModelConfig

__all__ = ["DEFAULT_MODEL", "ModelConfig", "Transformer", "Engine"]


def __getattr__(name):
    # the model loads the op library and the engine the loader (safetensors etc.): import them on first use, so
    # light modules (config, cli argument parsing) need neither
    if name == "Transformer":
        from dsv4_model.model.transformer import Transformer

        return Transformer
    if name == "Engine":
        from dsv4_model.runtime.engine import Engine

        return Engine
    raise AttributeError(name)
