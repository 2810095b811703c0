"""Pure-PyTorch references of the dsv4 ops, the ground truth of the numerics tests.

One module per op family; each is written from the op's documented definition (docs/ops.md),
independently of the C++/CUDA kernels.
"""
from dsv4_ops.reference.quant import *  # noqa: F401,F403
from dsv4_ops.reference.sample import *  # noqa: F401,F403
from dsv4_ops.reference.indexer import *  # noqa: F401,F403
from dsv4_ops.reference.gemm import *  # noqa: F401,F403
from dsv4_ops.reference.mhc import *  # noqa: F401,F403
from dsv4_ops.reference.attn import *  # noqa: F401,F403
