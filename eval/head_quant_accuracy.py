"""What quantizing the head would cost in accuracy: the built-in model's (or a model directory's) logits on its
held-out text with the head as stored (bf16 values) against the head quantized to NVFP4 (ModelOpt's bytes,
`dsv4_model.quant.nvfp4.quantize_weight`, dequantized exactly) and to FP8 e4m3 with one fp32 scale per row
(amax / 448), the rest of the model unchanged (CPU, fp32, as the engine runs it there); and the head as
`--head-quant nvfp4` runs it (`quantize_head_`: block scales chosen for the least squared error,
`nvfp4.quantize_weight_mse`, through dsv4::nvfp4_linear, bf16 activations, fp32 logits from its sums).

    python eval/head_quant_accuracy.py [--model DIR] [--text FILE] [--window 512]

Per variant: top-1 agreement with the stored head's greedy token, mean KL(stored || variant) in nats per
position, and the text's perplexity (next-token NLL) under each.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dsv4_model.checkpoint.tokenizer import load_tokenizer  # noqa: E402
from dsv4_model.quant.nvfp4 import quantize_weight  # noqa: E402
from dsv4_model.quant.nvfp4_modules import nvfp4_draft_head  # noqa: E402
from dsv4_model.runtime.engine import Engine  # noqa: E402
from dsv4_ops import reference as ref  # noqa: E402

DEFAULT = os.path.join(ROOT, "dsv4_model", "assets", "default")
E4M3_MAX = 448.0
OP_HEAD = "--head-quant nvfp4 (W4A16)"


def nvfp4_head(w: torch.Tensor) -> torch.Tensor:
    packed, scale, gs = quantize_weight(w)
    return ref.nvfp4_gemm_dequant_ref(packed, scale, gs)


def fp8_row_head(w: torch.Tensor) -> torch.Tensor:
    s = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-30)
    return (w / s).to(torch.float8_e4m3fn).float() * s


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT)
    ap.add_argument("--text", default=None, help="default: the model directory's heldout_sample.txt")
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args(argv)
    model = Engine.from_pretrained(args.model, device="cpu", dtype=torch.float32, max_batch_size=1,
                                   max_seq_len=args.window, progress=False, compile=False).model
    text = open(args.text or os.path.join(args.model, "heldout_sample.txt"), encoding="utf-8").read()
    ids = load_tokenizer(args.model, model.config).encode(text)
    stored = model.head.weight.detach().clone()
    variants = {"stored (bf16)": stored, "NVFP4": nvfp4_head(stored.float()),
                "FP8 e4m3, scale per row": fp8_row_head(stored.float())}
    stored_head, op_head = model.head, nvfp4_draft_head(model.head)  # the module quantize_head_ makes of it
    W = args.window
    sums = {name: [0, 0.0, 0.0] for name in [*variants, OP_HEAD]}  # top-1 agreements, KL sum, NLL sum
    n = 0
    for i in range(0, len(ids) - W, W):
        x = torch.tensor([ids[i:i + W]])
        h = model.streams(x, torch.tensor([W]))
        target = torch.tensor(ids[i + 1:i + W + 1])
        logp = {}
        for name, w in variants.items():
            model.head.weight = torch.nn.Parameter(w.to(stored.dtype) if name.startswith("stored") else w,
                                                   requires_grad=False)
            logp[name] = torch.log_softmax(model._logits(h)[0].double(), dim=-1)
        model.head.weight = torch.nn.Parameter(stored, requires_grad=False)
        model.head = op_head
        logp[OP_HEAD] = torch.log_softmax(model._logits(h)[0].double(), dim=-1)
        model.head = stored_head
        base = logp["stored (bf16)"]
        top = base.argmax(-1)
        for name, lp in logp.items():
            sums[name][0] += int((lp.argmax(-1) == top).sum())
            sums[name][1] += float((base.exp() * (base - lp)).sum())
            sums[name][2] += float(-lp.gather(1, target[:, None]).sum())
        n += W
    print(f"{args.model}: {n} positions ({n // W} windows of {W}); head {tuple(stored.shape)} {stored.dtype}")
    print(f"{'head':<26} {'top-1 agreement':>16} {'mean KL, nats':>14} {'perplexity':>11}")
    for name, (agree, kl, nll) in sums.items():
        print(f"{name:<26} {100 * agree / n:15.2f}% {kl / n:14.2e} {math.exp(nll / n):11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
