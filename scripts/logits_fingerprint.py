"""Prefill + decode logits of the default model and of the tiny random checkpoints in every layout, on the CPU,
saved to one file: run it in two checkouts and compare with --against, to show a refactor leaves the numerics
bit for bit as they were.

  python scripts/logits_fingerprint.py --out /tmp/a.pt                   # in the old checkout
  python scripts/logits_fingerprint.py --out /tmp/b.pt --against /tmp/a.pt   # in the new one: exit 1 on a difference
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYOUTS = ("dsv4", "hf", "official", "modelopt")


def _run(path, quant, dtype, steps=12) -> torch.Tensor:
    from dsv4_model.runtime.engine import Engine

    eng = Engine.from_pretrained(path, device="cpu", dtype=dtype, max_batch_size=2, max_seq_len=64, quant=quant,
                                 progress=False, compile=False)
    vocab = eng.config.vocab_size
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    out = [eng.prefill(ids, lengths=torch.tensor([9, 5]))]
    nxt = out[0].argmax(-1)
    for _ in range(steps):  # greedy, teacher-free: the logits of every step
        out.append(eng.decode(nxt))
        nxt = out[-1].argmax(-1)
    return torch.stack(out)


def fingerprint() -> dict[str, torch.Tensor]:
    import warnings

    from dsv4_model.checkpoint.writer import write_tiny_checkpoint
    from dsv4_model.runtime.cli import DEFAULT_MODEL_DIR

    res = {}
    for quant in ("none", "nvfp4"):
        res[f"default/{quant}"] = _run(DEFAULT_MODEL_DIR, quant, torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layout in LAYOUTS:
            d = os.path.join(tmp, layout)
            write_tiny_checkpoint(d, layout, seed=0)
            for quant in ("none", "nvfp4"):
                res[f"tiny-{layout}/{quant}"] = _run(d, quant, torch.float32)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--against", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)  # one summation order
    res = fingerprint()
    torch.save(res, a.out)
    if a.against is None:
        print(f"{len(res)} logit sets written to {a.out}")
        return 0
    old = torch.load(a.against)
    bad = [k for k in sorted(set(old) | set(res)) if k not in old or k not in res or not torch.equal(old[k], res[k])]
    for k in sorted(res):
        print(f"{k:>22}: {'identical' if k not in bad else 'DIFFERS'} ({tuple(res[k].shape)})")
    print("bit for bit identical" if not bad else f"{len(bad)} of {len(res)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
