"""Write a random tiny DeepSeek-V4 checkpoint in one of the loader's layouts (or ModelOpt NVFP4 experts).

    python scripts/make_tiny_checkpoint.py --layout official --out /tmp/tiny-official [--seed 0] [--config tiny]

The same --seed/--config give the same weights in every layout (the official layout stores them
as FP8 / MXFP4, modelopt as official with lossless NVFP4 routed experts, the others as their exact
dequantized values), so all layouts load to identical models.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4_model.checkpoint.writer import CONFIGS, WRITER_LAYOUTS, write_tiny_checkpoint  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=WRITER_LAYOUTS, required=True)
    ap.add_argument("--out", required=True, help="output directory (created if missing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors shards (>1 writes an index)")
    args = ap.parse_args(argv)
    cfg = write_tiny_checkpoint(args.out, args.layout, seed=args.seed, config=args.config, num_shards=args.shards)
    print(f"wrote {args.layout} checkpoint ({args.config}, seed {args.seed}, dim {cfg.dim}, {cfg.n_layers} layers) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
