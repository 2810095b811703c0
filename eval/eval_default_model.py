"""Held-out perplexity of the built-in default model: bf16 vs NVFP4 W4A16 vs NVFP4 W4A4, side by side, with
each NVFP4 variant's top-1 agreement with bf16 (same positions, teacher-forced).

    python eval/eval_default_model.py                      # CPU or GPU (--device), prints the table
    python eval/eval_default_model.py --device cpu --write # also records eval.json next to the model

Text: the model directory's ``heldout_sample.txt`` (cut by the training script from files held out by path
hash), encoded with the model's own tokenizer as ``<bos> doc <eos> ...`` and cut into non-overlapping windows
of --seq-len tokens, each run from position 0 through ``Transformer.prefill`` (the inference path).

Variants are the engine's own load paths (`dsv4_model.checkpoint.loader.load_model`): "bf16" = float weights (for an
NVFP4-stored checkpoint such as the shipped one: its dequantized NVFP4 values), "nvfp4_w4a16" = quant="nvfp4"
(converted at load, ModelOpt convention, or as stored), "nvfp4_w4a4" = the same weights with act_quant="nvfp4"
(every NVFP4 GEMM input quantized per token). What is converted and what stays bf16: dsv4_model/quant/quantize_model.py.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # train_data

import train_data as td  # noqa: E402

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "dsv4_model" / "assets" / "default"
MODES = ("bf16", "nvfp4_w4a16", "nvfp4_w4a4")
SAMPLE_NAME = "heldout_sample.txt"
EVAL_NAME = "eval.json"
CI_WINDOWS = 4  # what tests/test_default_model.py recomputes on a CPU


def sample_sha256(model_dir: Path) -> str:
    return hashlib.sha256((Path(model_dir) / SAMPLE_NAME).read_bytes()).hexdigest()


def heldout_windows(model_dir: Path, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """[n, seq_len + 1] token windows of the shipped held-out sample."""
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = td.sample_documents((model_dir / SAMPLE_NAME).read_text())
    return td.eval_windows(td.encode_documents(tok, docs), seq_len, max_windows)


QUANT_OF_MODE = {"bf16": ("none", "none"), "nvfp4_w4a16": ("nvfp4", "none"), "nvfp4_w4a4": ("nvfp4", "nvfp4")}


def load(model_dir: Path, device, *, batch: int, seq_len: int, simulate_quant: bool, mode: str = "bf16",
         dtype=torch.bfloat16):
    from dsv4_model.checkpoint.loader import load_model

    quant, act_quant = QUANT_OF_MODE[mode]
    model, _ = load_model(model_dir, device=device, dtype=dtype, max_batch_size=batch, max_seq_len=seq_len,
                          simulate_quant=simulate_quant, progress=False, quant=quant, act_quant=act_quant)
    return model


# ------------------------------------------------------------------------------------------------- scoring
@torch.no_grad()
def score(model, windows: torch.Tensor, batch: int) -> tuple[float, int, torch.Tensor]:
    """(summed NLL in nats, token count, top-1 ids [n, seq]) over the windows, via Transformer.prefill."""
    nll, count, top1 = 0.0, 0, []
    dev = model.device
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch].to(dev)
        logits = model.prefill(w[:, :-1], all_logits=True).float()
        nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
        top1.append(logits.argmax(-1).cpu())
    return nll, count, torch.cat(top1)


def evaluate(model_dir: Path, device="cpu", *, seq_len: int = 512, max_windows: int | None = None, batch: int = 4,
             simulate_quant: bool = True, modes=MODES, log=print) -> dict:
    model_dir = Path(model_dir)
    windows = heldout_windows(model_dir, seq_len, max_windows)
    if windows.shape[0] == 0:
        raise ValueError(f"{model_dir / SAMPLE_NAME} is shorter than one window of {seq_len} tokens")
    batch = min(batch, windows.shape[0])
    results: dict = {}
    ref_top1 = None
    for mode in modes:
        t0 = time.perf_counter()
        model = load(model_dir, device, batch=batch, seq_len=seq_len, simulate_quant=simulate_quant, mode=mode)
        nll, count, top1 = score(model, windows, batch)
        r = {"loss": nll / count, "ppl": math.exp(nll / count), "seconds": round(time.perf_counter() - t0, 2)}
        # the first CI_WINDOWS windows alone: the value the CPU test recomputes
        if windows.shape[0] >= CI_WINDOWS:
            ci_nll, ci_count, _ = score(model, windows[:CI_WINDOWS], batch)
            r["ci_ppl"] = math.exp(ci_nll / ci_count)
        if mode == "bf16":
            ref_top1 = top1
        elif ref_top1 is not None:
            r["top1_agreement"] = float((top1 == ref_top1).float().mean())
        results[mode] = r
        log(f"[eval] {mode}: ppl {r['ppl']:.4f} ({r['seconds']:.1f}s)")
        del model
    return {"model_dir": str(model_dir), "sample": SAMPLE_NAME, "sample_sha256": sample_sha256(model_dir),
            "seq_len": seq_len, "windows": int(windows.shape[0]), "tokens": int(windows[:, 1:].numel()),
            "ci_windows": CI_WINDOWS, "simulate_quant": simulate_quant, "device": str(device),
            "torch": torch.__version__, "results": results}


def format_table(ev: dict) -> str:
    rows = [f"held-out perplexity, {ev['tokens']:,} tokens ({ev['windows']} x {ev['seq_len']}), "
            f"simulate_quant={ev['simulate_quant']}, {ev['device']}",
            f"{'variant':<14}{'loss (nats)':>12}{'ppl':>10}{'vs bf16':>10}{'top-1 agree':>13}"]
    base = ev["results"].get("bf16", {}).get("ppl")
    for mode, r in ev["results"].items():
        rel = f"{100 * (r['ppl'] / base - 1):+.2f}%" if base and mode != "bf16" else "-"
        agree = f"{100 * r['top1_agreement']:.2f}%" if "top1_agreement" in r else "-"
        rows.append(f"{mode:<14}{r['loss']:>12.4f}{r['ppl']:>10.4f}{rel:>10}{agree:>13}")
    return "\n".join(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, help="at most this many windows (default: the whole sample)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--simulate-quant", choices=("on", "off"), default="on",
                    help="the QAT numerics of the inference model (FP8 KV, FP4 indexer); on = engine default")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--write", action="store_true", help=f"write {EVAL_NAME} into the model directory")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = set(modes) - set(MODES)
    if bad:
        ap.error(f"unknown modes {sorted(bad)}; choose from {MODES}")
    ev = evaluate(args.model, args.device, seq_len=args.seq_len, max_windows=args.windows, batch=args.batch,
                  simulate_quant=args.simulate_quant == "on", modes=modes)
    print(format_table(ev))
    if args.write:
        (args.model / EVAL_NAME).write_text(json.dumps(ev, indent=2) + "\n")
        print(f"wrote {args.model / EVAL_NAME}")
    return ev


if __name__ == "__main__":
    main()
