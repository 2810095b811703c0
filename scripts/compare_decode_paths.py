"""Teacher-forced comparison of the decode paths on one model: how far compiled (and CUDA-graph) decode
logits drift from eager decode logits, step by step, on the same tokens (tests/helpers/decode_compare.py).

A kernel bug shows as a drift far above the bf16 rounding level (~1e-2 on the default model's logits); a
near-tie as an argmax flip where eager's top-2 margin is below the drift.

Run (GPU): python scripts/compare_decode_paths.py [--model DIR] [--dtype float32] [--steps 32]
           python scripts/compare_decode_paths.py --kernel-overrides nvfp4_gemm_kernel=skinny   (M <= 64 kernel)
           python scripts/compare_decode_paths.py --paths verify-2,verify-4   (speculation's verification)
CPU dry run: python scripts/compare_decode_paths.py --device cpu --paths compiled --steps 4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.decode_compare import decidable, eager_decode, forced_decode, multi_token_decode  # noqa: E402
from dsv4_model.runtime.engine import Engine  # noqa: E402
from dsv4_model.checkpoint.tokenizer import load_tokenizer  # noqa: E402
from dsv4_ops.overrides import current as current_overrides  # noqa: E402
from dsv4_ops.overrides import parse as parse_overrides  # noqa: E402
from dsv4_ops.overrides import set_overrides  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef "]
PATHS = {  # name -> DecodeRunner options
    "compiled": dict(compile=True, cuda_graphs=False),
    "graph-manual": dict(compile=True, cuda_graphs=True, graph_mode="manual"),
    "graph-reduce-overhead": dict(compile=True, cuda_graphs=True, graph_mode="reduce-overhead"),
}
VERIFY = {"verify-2": 2, "verify-4": 4}  # eager multi-token decode, 2 / 4 tokens (--speculate 1 / 3's verification)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / "dsv4_model" / "assets" / "default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join([*PATHS, *VERIFY])}")
    ap.add_argument("--kernel-overrides", default="", help='dsv4_ops.overrides, e.g. "nvfp4_gemm_kernel=skinny"')
    args = ap.parse_args(argv)
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=getattr(torch, args.dtype),
                                    max_batch_size=len(PROMPTS), max_seq_len=128, progress=False)
    tok = load_tokenizer(args.model, engine.config)
    prompts = [tok.encode(p) for p in PROMPTS]  # BOS first
    set_overrides(parse_overrides(args.kernel_overrides))
    print(f"model {args.model.name}, {args.dtype} on {args.device}, kernels: {current_overrides()}")
    fed, ref = eager_decode(engine, prompts, args.steps)
    top2 = ref.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    for name in args.paths.split(","):
        got = (multi_token_decode(engine, prompts, fed, VERIFY[name]) if name in VERIFY
               else forced_decode(engine, prompts, fed, **PATHS[name]))
        drift = (got - ref).abs().amax(-1)  # [steps, B]
        flips = got.argmax(-1) != ref.argmax(-1)
        s, r = divmod(int(drift.flatten().argmax()), drift.shape[1])
        print(f"{name:>22}: max |dlogit| {float(drift.max()):.3e} (step {s}, row {r}), median "
              f"{float(drift.median()):.3e}; decidable {float(decidable(got, ref).float().mean()):.0%}; "
              f"argmax flips {int(flips.sum())}"
              + "".join(f" [step {int(a)} row {int(b)}: eager margin {float(margin[a, b]):.2e}]"
                        for a, b in flips.nonzero()[:4]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
