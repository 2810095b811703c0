"""Write a random DeepSeek-V4 checkpoint of any size (a full V4-Flash / V4-Pro included) in the official, ModelOpt
or HF layout, streamed tensor by tensor into shards (the host holds one shard at a time): the sharded loader then
runs at real tensor sizes without a real checkpoint.

    python scripts/write_random_checkpoint.py --preset flash --layers 4 --experts 32 --layout official \\
        --out /tmp/flash4 [--max-shard-gb 4] [--device cuda] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4_model.checkpoint.writer import make_config, write_random_checkpoint  # noqa: E402
from dsv4_model.model.config import ModelConfig  # noqa: E402

PRESETS = {"tiny": lambda: make_config(), "flash": ModelConfig.v4_flash, "pro": ModelConfig.v4_pro}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="flash")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the preset's); their compress ratios "
                    "and hash layers are the preset's first ones")
    ap.add_argument("--experts", type=int, help="routed experts per layer (default: the preset's)")
    ap.add_argument("--mtp", type=int, help="MTP blocks (default: the preset's)")
    ap.add_argument("--layout", choices=("official", "modelopt", "hf"), default="official")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-shard-gb", type=float, default=4.0)
    ap.add_argument("--device", default="cpu", help="where the random values are made (cuda: faster)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset]().sliced(args.layers, args.experts, args.mtp)
    t0 = time.perf_counter()
    names = write_random_checkpoint(cfg, args.out, args.layout, seed=args.seed,
                                    max_shard_bytes=int(args.max_shard_gb * (1 << 30)), device=args.device)
    size = sum(os.path.getsize(os.path.join(args.out, n)) for n in names)
    print(f"wrote a random {args.preset} checkpoint ({cfg.n_layers} layers, {cfg.n_routed_experts} experts, "
          f"{args.layout} layout): {len(names)} shards, {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
