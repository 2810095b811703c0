"""How often the MTP block's drafts would be accepted under greedy speculative decoding, estimated teacher-forced on
a model's held-out text (default: the built-in model and its heldout_sample.txt), per draft position, and the
tokens per step that gives for K = 1..3 draft tokens.

    python eval/mtp_acceptance.py [--model DIR] [--text FILE] [--window 512] [--quant none|nvfp4]
    python eval/mtp_acceptance.py --generate 200        # also: measured, greedy speculative decoding (generate)
    python eval/mtp_acceptance.py --draft-head nvfp4    # drafts from an NVFP4 copy of the head (Engine.set_draft_head)

Per window, one pass of the main model gives its streams h_t and greedy tokens g_t (the prediction of x_{t+1});
pass k of the MTP block (its own output streams feeding the next pass, as a K-token draft chains it) gives the
draft d_k,t of x_{t+k+1} from tokens x_{t+1..t+k}. Greedy speculation at position t accepts draft k when every
earlier one was accepted and d_k,t equals the main model's greedy token at t+k; the estimate counts it where the
text agrees with those greedy tokens (so the teacher-forced inputs are what a greedy run would have fed):
a_k = P(d_k,t = g_t+k | g_t+j = x_t+j+1 for j < k, and drafts 1..k-1 accepted). Tokens per step with K drafts:
1 + a_1 + a_1 a_2 + ... (the bonus token included). Drafts 2..3 come from whole passes over the sequence (the
block's cache holding that pass's entries everywhere), where a running chain reads the entries its committed
positions got from pass 1: an approximation; the measured rates come with the speculative engine.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dsv4_model.checkpoint.tokenizer import load_tokenizer  # noqa: E402
from dsv4_model.model import mtp  # noqa: E402
from dsv4_model.runtime.engine import DRAFT_HEADS, Engine  # noqa: E402

DEFAULT = os.path.join(ROOT, "dsv4_model", "assets", "default")


@torch.no_grad()
def window_counts(model, ids: torch.Tensor, depth: int) -> tuple[list[int], list[int], int, int]:
    """ids [1, S] -> (accepted[k], eligible[k] for k < depth, MTP-1 top-1 hits against the text, positions)."""
    S = ids.shape[1]
    lengths = torch.tensor([S])
    h = model.streams(ids, lengths)
    g = model._logits(h).argmax(-1)[0]  # g[t]: greedy prediction of x[t+1]
    x = ids[0]
    drafts = []
    for k in range(1, depth + 1):  # pass k reads tokens x[t+k] and drafts x[t+k+1]
        n = S - k
        logits, h = mtp.prefill(model, h[:, :n], ids[:, k:], torch.tensor([n]))
        drafts.append(logits.argmax(-1)[0])
    accepted, eligible = [0] * depth, [0] * depth
    T = S - depth - 1
    for t in range(T):
        for k in range(depth):
            # the inputs so far are a greedy run's: x[t+j+1] = g[t+j] for j <= k
            if int(g[t + k]) != int(x[t + k + 1]):
                break
            eligible[k] += 1
            if int(drafts[k][t]) != int(g[t + k + 1]):
                break
            accepted[k] += 1
    hits = int((drafts[0][:T] == x[2:T + 2]).sum())
    return accepted, eligible, hits, T


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT)
    ap.add_argument("--text", default=None, help="default: the model directory's heldout_sample.txt")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--depth", type=int, default=3, help="draft positions to estimate")
    ap.add_argument("--quant", default=None, help="none | nvfp4 (default: as stored)")
    ap.add_argument("--draft-head", default="stored", choices=DRAFT_HEADS,
                    help="the head the MTP block's drafts read (the main model's stays as stored)")
    ap.add_argument("--generate", type=int, default=0,
                    help="also decode this many tokens from the first 8 held-out lines as prompts with K = 1..depth "
                         "drafts (generate(..., speculate=K)) and report the measured rates")
    args = ap.parse_args(argv)
    eng = Engine.from_pretrained(args.model, device="cpu", dtype=torch.float32, max_batch_size=1,
                                 max_seq_len=args.window, quant=args.quant, progress=False, compile=False)
    eng.set_draft_head(args.draft_head)
    model = eng.model
    if not model.config.n_mtp_layers:
        print(f"error: {args.model} has no MTP block", file=sys.stderr)
        return 2
    text = open(args.text or os.path.join(args.model, "heldout_sample.txt"), encoding="utf-8").read()
    ids = load_tokenizer(args.model, model.config).encode(text)
    W = args.window
    acc, elig, hits, n = [0] * args.depth, [0] * args.depth, 0, 0
    for i in range(0, len(ids) - W + 1, W):
        a, e, h, t = window_counts(model, torch.tensor([ids[i:i + W]]), args.depth)
        acc = [p + q for p, q in zip(acc, a)]
        elig = [p + q for p, q in zip(elig, e)]
        hits, n = hits + h, n + t
    rates = [a / e if e else float("nan") for a, e in zip(acc, elig)]
    print(f"{args.model}: {n} positions in {len(ids) // W} windows of {W} tokens; draft head {args.draft_head}; "
          f"MTP top-1 vs the text (token after next): {100 * hits / n:.1f}%")
    print(f"{'draft':>5} {'eligible':>9} {'accepted':>9} {'rate':>7}   {'K':>2} {'tokens/step':>11}")
    per_step = 1.0
    chain = 1.0
    for k, (a, e, r) in enumerate(zip(acc, elig, rates), start=1):
        chain *= r
        per_step += chain
        print(f"{k:5d} {e:9d} {a:9d} {100 * r:6.1f}%   {k:2d} {per_step:11.2f}")
    if args.generate:
        measure(args, text, args.generate)
    return 0


def measure(args, text: str, n: int) -> None:
    """Greedy speculative decoding (generate(..., speculate=K), the served path) of up to n tokens per prompt
    (8 held-out lines, one batch; a row stops at EOS) at K = 1..depth."""
    from dsv4_model.runtime.generate import generate

    lines = [ln for ln in text.splitlines() if len(ln.strip()) > 8][:8]
    for k in range(1, args.depth + 1):
        eng = Engine.from_pretrained(args.model, device="cpu", dtype=torch.float32, max_batch_size=len(lines),
                                     max_seq_len=args.window, quant=args.quant, progress=False, compile=False,
                                     spare_window_slots=k)
        eng.set_draft_head(args.draft_head)
        tok = load_tokenizer(args.model, eng.model.config)
        ids = [tok.encode(ln + "\n") for ln in lines]
        stats = generate(eng, ids, max_new_tokens=n, speculate=k).extra["speculation"]
        rates = " / ".join(f"{100 * r:.1f}%" for r in stats.acceptance())
        print(f"measured, K = {k}: {len(lines)} prompts x {n} tokens, {stats.steps} steps, acceptance per draft "
              f"{rates}, {stats.tokens_per_step:.2f} tokens per step")


if __name__ == "__main__":
    sys.exit(main())
