"""Pure-PyTorch references of the dsv4 ops, the ground truth of the numerics tests.

One module per op family, named as the family's kernels (csrc/cpu/<family>.cpp) and fakes (fakes/<family>.py);
each is written from the op's documented definition (docs/ops.md), independently of the C++/CUDA kernels.
Every public reference is named after its op with the suffix ``_ref``.
"""
from dsv4_ops.reference.nvfp4_quant import *  # noqa: F401,F403
from dsv4_ops.reference.sample import *  # noqa: F401,F403
from dsv4_ops.reference.indexer import *  # noqa: F401,F403
from dsv4_ops.reference.nvfp4_gemm import *  # noqa: F401,F403
from dsv4_ops.reference.mhc import *  # noqa: F401,F403
from dsv4_ops.reference.fp32_linear import *  # noqa: F401,F403
from dsv4_ops.reference.attn import *  # noqa: F401,F403
from dsv4_ops.reference.router import *  # noqa: F401,F403
from dsv4_ops.reference.compressor import *  # noqa: F401,F403
from dsv4_ops.reference.norm_rope import *  # noqa: F401,F403
from dsv4_ops.reference.hadamard import *  # noqa: F401,F403
from dsv4_ops.reference.key_store import *  # noqa: F401,F403
