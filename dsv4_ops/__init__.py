"""dsv4_ops: the DeepSeek-V4 custom-op library.

Importing this package loads the compiled library once (registering ``torch.ops.dsv4.*``) and then the
Python fakes, so every op works under FakeTensor, torch.compile and torch.export.
"""
from dsv4_ops._loader import built_with_cuda, library_path, load

load()

__all__ = ["built_with_cuda", "library_path", "load"]
