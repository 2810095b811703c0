"""Ship a trained default model: convert it to NVFP4 (W4A16) and write it into dsv4_model/assets/default/.

    python scripts/ship_default_model.py out/default_model     # the directory train_default_model.py wrote

The routed experts (stored MXFP4 by training) convert losslessly to NVFP4; the attention projections, wo_a and
the shared expert are quantized post-training (per-tensor amax, ModelOpt convention); everything else stays as
trained (dsv4_model/quant/quantize_model.py says what and why). The checkpoint carries the `dsv4_quant` marker, so
the engine loads the NVFP4 buffers as they are. Before converting, the held-out table of the trained weights
(bf16 vs NVFP4 W4A16 vs W4A4, eval/eval_default_model.py) is printed for bench/RESULTS.md; afterwards
`eval.json` of the shipped model is written (tests/test_default_model.py checks against it).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval"))

import eval_default_model as ev  # noqa: E402
from dsv4_model.checkpoint.loader import load_model, save_model  # noqa: E402

EXTRA_FILES = ("tokenizer.json", "heldout_sample.txt", "train_log.json", "loss_curve.png")
MAX_SHARD_BYTES = 15 * 2**20  # files the GPU machine can hand back, and friendly to git


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trained", type=Path)
    ap.add_argument("--out", type=Path, default=ev.DEFAULT_DIR)
    args = ap.parse_args(argv)

    trained = ev.evaluate(args.trained, "cpu")
    print("trained weights:\n" + ev.format_table(trained))
    model, cfg = load_model(args.trained, device="cpu", dtype=torch.bfloat16, quant="nvfp4", act_quant="none",
                            progress=False)
    if args.out.exists():
        shutil.rmtree(args.out)
    save_model(model, cfg, args.out, max_shard_bytes=MAX_SHARD_BYTES)
    for name in EXTRA_FILES:
        if (args.trained / name).is_file():
            shutil.copy(args.trained / name, args.out / name)
    shipped = ev.evaluate(args.out, "cpu")
    shipped["trained_weights"] = trained["results"]
    (args.out / ev.EVAL_NAME).write_text(json.dumps(shipped, indent=2) + "\n")
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print("shipped (NVFP4 stored; bf16 = its dequantized weights):\n" + ev.format_table(shipped))
    print(f"wrote {args.out} ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
