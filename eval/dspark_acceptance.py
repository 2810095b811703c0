"""How often a trained DSpark module's greedy drafts (scripts/train_dspark.py's output) are accepted, next to the
model's MTP block, on the held-out text (default: the built-in model and its heldout_sample.txt).

    python eval/dspark_acceptance.py --dspark out/dspark_default [--model DIR] [--generate 64] [--ks 1,3,5]

Teacher-forced (as eval/mtp_acceptance.py, whose MTP figures it prints beside): per window the main model gives
its greedy tokens g_t (prediction of x_{t+1}) and the DSpark context of every position; the block at anchor
`last` = t (anchor token x_{t+1}, the ring holding positions <= t: scripts/dspark_training.py's blocks, equal to
DSpark.commit + draft) drafts d_i for x_{t+2+i}, its Markov bias reading its own drafts. Draft i counts as offered
where the inputs so far are a greedy run's (g_{t+j} = x_{t+j+1} for j <= i) and drafts < i were accepted, and as
accepted where d_i = g_{t+1+i}. Tokens per step with K drafts: 1 + a_1 + a_1 a_2 + ...

--generate N: measured through real greedy speculation (generate(engine, prompts, speculate=K) with the DSpark
attached, 8 held-out lines as prompts), asserting its tokens equal plain greedy's; MTP's measured figures beside.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "eval"))

import dspark_training as dt  # noqa: E402
import mtp_acceptance  # noqa: E402
from dsv4_model.checkpoint.loader import load_drafter  # noqa: E402
from dsv4_model.checkpoint.tokenizer import load_tokenizer  # noqa: E402
from dsv4_model.model.dspark import DSpark, attach  # noqa: E402
from dsv4_model.runtime.engine import Engine  # noqa: E402

DEFAULT = mtp_acceptance.DEFAULT


def load_dspark(path: str, cfg, max_batch_size: int, simulate_quant: bool = True) -> DSpark:
    """scripts/train_dspark.py's directory -> a DSpark for the model of config cfg (fp32), to attach beside the
    model's own MTP block."""
    return load_drafter(path, cfg, dtype=torch.float32, max_batch_size=max_batch_size,
                        simulate_quant=simulate_quant)


@torch.no_grad()
def window_counts(model, d: DSpark, ids: torch.Tensor) -> tuple[list[int], list[int], int, int]:
    """ids [1, S] -> (accepted[i], offered[i] for block position i, position-0 top-1 hits vs the text, anchors)."""
    S, T = ids.shape[1], d.block_size
    taps = {}

    def tap(layer_id, h):
        if layer_id in d.target_layer_ids:
            taps[layer_id] = h

    h = model.streams(ids, torch.tensor([S]), before_layer=tap)
    g = model._logits(h).argmax(-1)[0]
    hidden = torch.cat([taps[i].mean(dim=-2) for i in d.target_layer_ids], dim=-1)
    n = S - T - 1  # anchors whose block's targets are inside the window
    last = torch.arange(n).unsqueeze(0)
    blocks, blk, _ = dt.block_streams(d, model, hidden, ids, last, static_moe=False)
    drafts = dt.greedy_head(d, model, blocks, blk[:, 0]).tokens  # [n, T]
    x = ids[0]
    acc, off = [0] * T, [0] * T
    for t in range(n):
        for i in range(T):
            if int(g[t + i]) != int(x[t + i + 1]):  # input t + i + 1 (anchor, then accepted drafts) not greedy's
                break
            off[i] += 1
            if int(drafts[t, i]) != int(g[t + 1 + i]):
                break
            acc[i] += 1
    hits = int((drafts[:, 0] == x[2:n + 2]).sum())
    return acc, off, hits, n


def table(name: str, acc: list[int], off: list[int]) -> list[float]:
    print(f"{name}\n{'draft':>5} {'offered':>8} {'accepted':>9} {'rate':>7}   {'K':>2} {'tokens/step':>11}")
    per_step, chain, rates = 1.0, 1.0, []
    for k, (a, o) in enumerate(zip(acc, off), start=1):
        r = a / o if o else float("nan")
        rates.append(r)
        chain *= r
        per_step += chain
        print(f"{k:5d} {o:8d} {a:9d} {100 * r:6.1f}%   {k:2d} {per_step:11.2f}")
    return rates


def measure(args, text: str, n: int) -> None:
    """generate(..., speculate=K) with the DSpark attached and with the MTP block, each against plain greedy."""
    from dsv4_model.runtime.generate import generate

    lines = [ln for ln in text.splitlines() if len(ln.strip()) > 8][:args.prompts]
    ks = [int(k) for k in args.ks.split(",")]
    eng = Engine.from_pretrained(args.model, device="cpu", dtype=torch.float32, max_batch_size=len(lines),
                                 max_seq_len=args.window, quant=args.quant, progress=False, compile=False,
                                 spare_window_slots=max(ks))
    tok = load_tokenizer(args.model, eng.model.config)
    ids = [tok.encode(ln + "\n") for ln in lines]
    plain = generate(eng, ids, max_new_tokens=n).token_ids
    d = load_dspark(args.dspark, eng.model.config, len(lines))
    for k in ks:
        for method in ("dspark", "mtp"):
            if method == "mtp" and k > 3:
                continue
            attach(eng.model, d if method == "dspark" else None)
            res = generate(eng, ids, max_new_tokens=n, speculate=k, speculate_method=method)
            assert res.token_ids == plain, f"{method} K={k}: speculative output differs from plain greedy"
            st = res.extra["speculation"]
            rates = " / ".join(f"{100 * r:.1f}%" for r in st.acceptance())
            pred = ""
            if method == "dspark" and st.predicted_rows:
                pred = "; confidence head predicted " + " / ".join(f"{100 * p:.1f}%" for p in st.predicted_acceptance())
            print(f"measured {method:6s} K = {k}: {len(lines)} prompts x {n} tokens (= plain greedy), {st.steps} "
                  f"steps, acceptance per draft {rates}, {st.tokens_per_step:.2f} tokens per step{pred}", flush=True)
    attach(eng.model, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dspark", required=True, help="scripts/train_dspark.py's --out directory")
    ap.add_argument("--model", default=DEFAULT)
    ap.add_argument("--text", default=None, help="default: the model directory's heldout_sample.txt")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--quant", default=None, help="none | nvfp4 (default: as stored)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--generate", type=int, default=0, help="also measure through generate: tokens per prompt")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--ks", default="1,3,5", help="draft counts K for --generate")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    eng = Engine.from_pretrained(args.model, device="cpu", dtype=torch.float32, max_batch_size=1,
                                 max_seq_len=args.window, quant=args.quant, progress=False, compile=False)
    model = eng.model
    d = load_dspark(args.dspark, model.config, 1)
    text = open(args.text or os.path.join(args.model, "heldout_sample.txt"), encoding="utf-8").read()
    ids = load_tokenizer(args.model, model.config).encode(text)
    W, T = args.window, d.block_size
    acc, off, hits, n = [0] * T, [0] * T, 0, 0
    macc, moff = [0] * 3, [0] * 3
    for i in range(0, len(ids) - W + 1, W):
        w = torch.tensor([ids[i:i + W]])
        a, o, h, t = window_counts(model, d, w)
        acc, off = [p + q for p, q in zip(acc, a)], [p + q for p, q in zip(off, o)]
        hits, n = hits + h, n + t
        if model.config.n_mtp_layers:
            a, o, _, _ = mtp_acceptance.window_counts(model, w, 3)
            macc, moff = [p + q for p, q in zip(macc, a)], [p + q for p, q in zip(moff, o)]
    print(f"{args.model} + DSpark {args.dspark}: {n} anchors in {len(ids) // W} windows of {W} tokens; DSpark "
          f"position-0 top-1 vs the text (token after next): {100 * hits / n:.1f}%")
    table(f"DSpark ({d.n_stages} stages, block {T}), teacher-forced, greedy drafts vs the main model's greedy:", acc, off)
    if model.config.n_mtp_layers:
        table("MTP block (eval/mtp_acceptance.py), same text:", macc, moff)
    if args.generate:
        measure(args, text, args.generate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
