"""Fake (meta) implementations of every dsv4 op, one module per op family.

Each module calls ``torch.library.register_fake`` for the ops of its section of the schema table.
"""
from dsv4_ops.fakes import nvfp4_quant  # noqa: F401
from dsv4_ops.fakes import sample  # noqa: F401
from dsv4_ops.fakes import indexer  # noqa: F401
from dsv4_ops.fakes import nvfp4_gemm  # noqa: F401
from dsv4_ops.fakes import mhc  # noqa: F401
from dsv4_ops.fakes import fp32_linear  # noqa: F401
from dsv4_ops.fakes import router  # noqa: F401
from dsv4_ops.fakes import attn  # noqa: F401
from dsv4_ops.fakes import compressor  # noqa: F401
from dsv4_ops.fakes import norm_rope  # noqa: F401
from dsv4_ops.fakes import hadamard  # noqa: F401
from dsv4_ops.fakes import key_store  # noqa: F401
