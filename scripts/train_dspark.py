"""Train a DSpark speculative module (docs/dspark.md) for a frozen main model, by default the built-in one, on the
text that model was trained on (scripts/train_data.py's train split; validation and held-out files excluded):

    python scripts/train_dspark.py --out out/dspark_default --minutes 25 --device cpu --threads 1

The main model stays frozen (fp32, as loaded); per step it gives the target layers' input streams of a batch of
windows (scripts/dspark_training.py main_context), and the DSpark blocks at random anchors of each window
(block_streams) are trained with the cross-entropy of each block position's Markov-biased logits (teacher-forced:
the bias reads the true previous token) against the true token (position i drafts the token at last + 2 + i),
plus --conf-weight x BCE of the confidence head against whether that position's greedy draft was right.
Stages 0..S-1 start from the model's MTP block (the same Block shapes: a window-only layer with a learned router;
its router biases stay as they are); main_proj starts random, the Markov and confidence heads at zero bias.
AdamW, warm-up + cosine over the time budget, like train_default_model.py.

Writes into --out: dspark.safetensors (the `DSpark.state_dict()` names, `mtp.0..S-1.*`, fp32), dspark_config.json
(the release's dspark_* keys + stage count), train_log.json (loss curve, per-position accuracy on validation
windows): a DSpark drafter directory (dsv4_model/checkpoint/drafter.py), loaded with
`python -m dsv4_model generate --speculate K --drafter DIR` (serve: the same option) or load_model(drafter=DIR).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import dspark_training as dt  # noqa: E402
import train_data as td  # noqa: E402

DEFAULT = ROOT / "dsv4_model" / "assets" / "default"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget of the training loop")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--markov-rank", type=int, default=32)
    ap.add_argument("--noise-token-id", type=int, default=0,
                    help="default 0 (<bos>: special, only ever at a document's start, never mid-text)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=48, help="random anchors per window and step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--conf-weight", type=float, default=0.1)
    ap.add_argument("--val-windows", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-files", type=int, help="only the first N train files (quick runs)")
    ap.add_argument("--init", type=Path, default=None, metavar="DIR",
                    help="start from this drafter directory's weights (an earlier run's --out: train it longer; its "
                         "config overrides --stages / --block-size / --markov-rank / --noise-token-id)")
    return ap.parse_args(argv)


def build(model_dir: Path, device, batch: int, seq_len: int, args):
    """The frozen main model (fp32, float weights) and a DSpark for it, its stages from the MTP block."""
    from dsv4_model.checkpoint.loader import load_model
    from dsv4_model.model.dspark import DSpark

    model, cfg = load_model(str(model_dir), device=device, dtype=torch.float32, max_batch_size=batch,
                            max_seq_len=seq_len, quant="none", progress=False)
    if args.init is not None:
        from dsv4_model.checkpoint.drafter import with_drafter

        sp = with_drafter(cfg, args.init).dspark
        args.stages, args.block_size = len(sp.stage_ratios), sp.block_size
        args.markov_rank, args.noise_token_id = sp.markov_rank, sp.noise_token_id
    dcfg = dt.dspark_config_for(cfg, args.stages, args.block_size, args.markov_rank, args.noise_token_id)
    d = DSpark(dcfg, dtype=torch.float32, max_batch_size=1, simulate_quant=False, device=device)
    d.init_random_weights(args.seed)
    with torch.no_grad():
        mtp = model.mtp[0].state_dict() if getattr(model, "mtp", None) is not None and len(model.mtp) else {}
        for st in d.mtp:
            own = st.state_dict()
            st.load_state_dict({k: v for k, v in mtp.items() if k in own and own[k].shape == v.shape}, strict=False)
        last = d.mtp[-1]
        last.markov_head.markov_w1.weight.normal_(0.0, 0.02)
        last.markov_head.markov_w2.weight.zero_()  # start as the plain head
        last.confidence_head.proj.weight.zero_()
        d.mtp[0].main_proj.weight.normal_(0.0, 0.02)
    if args.init is not None:  # an earlier run's module, checked against this model as the loader checks it
        from dsv4_model.checkpoint.loader import load_drafter

        d.load_state_dict(load_drafter(args.init, cfg, dtype=torch.float32, simulate_quant=False).state_dict())
    for p in model.parameters():
        p.requires_grad_(False)
    named = [(n, p.requires_grad_(not n.endswith("gate.bias"))) for n, p in d.named_parameters()]
    return model, cfg, d, dcfg, [(n, p) for n, p in named if p.requires_grad]


def anchors_for(B: int, S: int, T: int, A: int, gen: torch.Generator) -> torch.Tensor:
    """A distinct random anchors per row in [0, S - T - 2] (a block's targets must lie inside the window)."""
    hi = S - T - 1
    return torch.stack([torch.randperm(hi, generator=gen)[:A].sort().values for _ in range(B)])


@torch.no_grad()
def validate(model, d, windows: torch.Tensor, T: int, batch: int) -> dict:
    """Teacher-forced accuracy per block position against the text on validation windows (every anchor)."""
    hits, n, ce = torch.zeros(T), 0, torch.zeros(T)
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch].to(d.device)
        B, S = ids.shape
        last = torch.arange(S - T - 1, device=ids.device).repeat(B, 1)
        c, _, acc = dt.dspark_losses(d, model, dt.main_context(model, d, ids), ids, last)
        k = last.numel()
        hits, ce, n = hits + acc.cpu() * k, ce + c.cpu() * k, n + k
    return {"acc": (hits / n).tolist(), "ce": (ce / n).tolist()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    device = torch.device(args.device)
    from tokenizers import Tokenizer
    from safetensors.torch import save_file

    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    split = td.split_files(td.list_stdlib_files())
    if args.max_files:
        split["train"] = split["train"][:args.max_files]
    train = td.encode_documents(tok, td.read_texts(split["train"]))  # the held-out ("test") files: never read
    val = td.eval_windows(td.encode_documents(tok, td.read_texts(split["val"])), args.seq_len - 1, args.val_windows)
    print(f"[data] train {len(split['train'])} files / {train.numel():,} tokens; val {val.shape[0]} windows; "
          f"{time.perf_counter() - t0:.1f}s", flush=True)

    model, cfg, d, dcfg, named = build(args.model, device, max(args.batch_size, 1), args.seq_len, args)
    T = d.block_size
    decay = [p for n, p in named if p.dim() >= 2 and "hc_" not in n.rsplit(".", 1)[-1]]
    rest = [p for n, p in named if not (p.dim() >= 2 and "hc_" not in n.rsplit(".", 1)[-1])]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    n_params = sum(p.numel() for _, p in named)
    print(f"[model] DSpark {d.n_stages} stages, block {T}, markov rank {dcfg.dspark.markov_rank}, targets "
          f"{list(d.target_layer_ids)}, noise id {d.noise_token_id}; {n_params / 1e6:.2f}M trained parameters",
          flush=True)
    log = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "dspark": dcfg.dspark.config_keys() | {"n_stages": d.n_stages}, "params": n_params,
           "train": [], "val": []}
    log["val"].append({"step": 0, **validate(model, d, val, T, args.batch_size)})
    print(f"[val] step 0 acc/pos {[round(a, 3) for a in log['val'][-1]['acc']]}", flush=True)

    sampler = td.WindowSampler(train, args.batch_size, args.seq_len - 1, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    budget, t_train, step = args.minutes * 60.0, time.perf_counter(), 0
    while True:
        progress = (time.perf_counter() - t_train) / budget
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = sampler.next().to(device)
        B, S = ids.shape
        last = anchors_for(B, S, T, args.anchors, gen).to(device)
        ce, bce, acc = dt.dspark_losses(d, model, dt.main_context(model, d, ids), ids, last)
        loss = ce.mean() + args.conf_weight * bce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0:
            rec = {"step": step, "t": round(time.perf_counter() - t_train, 1), "lr": lr, "loss": loss.item(),
                   "ce": [round(c, 4) for c in ce.tolist()], "bce": bce.item(), "acc": [round(a, 4) for a in acc.tolist()]}
            log["train"].append(rec)
            print(f"[train] step {step} {rec['t']}s loss {rec['loss']:.3f} ce/pos {rec['ce']} acc/pos {rec['acc']}",
                  flush=True)
    log["steps"] = step
    log["val"].append({"step": step, **validate(model, d, val, T, args.batch_size)})
    print(f"[val] step {step} acc/pos {[round(a, 3) for a in log['val'][-1]['acc']]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous().cpu() for k, v in d.state_dict().items()},
              str(args.out / "dspark.safetensors"))
    (args.out / "dspark_config.json").write_text(json.dumps(log["dspark"], indent=2) + "\n")
    log["seconds"] = round(time.perf_counter() - t0, 1)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"[done] {step} steps, {log['seconds']}s; wrote {args.out}", flush=True)
    return log


if __name__ == "__main__":
    main()
