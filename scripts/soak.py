"""Soak: many decode steps through the real generation path, requests back to back so every cache row fills to
max_seq_len and starts over (engine reset + a new prompt each time), sampling with a seed.

Reports: steps, requests, tokens/s, device memory after the first request and at the end (must stay flat),
host RSS, non-finite logits seen, recompiles after the first request (must be 0), and a hash of every emitted
id; --runs 2 repeats the whole soak with the same seed in the same process and checks the hashes agree.

  python scripts/soak.py [--model DIR] [--steps 100000] [--batch 1] [--max-seq-len 256] [--runs 2]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(engine, steps: int, batch: int, seed: int, temperature: float) -> dict:
    """Requests of random prompts (8-64 ids) generated to the end of the caches until `steps` decode steps ran."""
    from torch._dynamo.utils import counters

    from dsv4_model.runtime.generate import generate

    rng = random.Random(seed)
    vocab, on_cuda = engine.config.vocab_size, engine.device.type == "cuda"
    digest, done, requests, nonfinite = hashlib.sha256(), 0, 0, 0
    mem_first = graphs_first = None
    t0 = time.perf_counter()
    while done < steps:
        prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(8, 64))] for _ in range(batch)]
        new = engine.max_seq_len - max(len(p) for p in prompts) + 1
        res = generate(engine, prompts, max_new_tokens=new, temperature=temperature, top_k=0, top_p=1.0,
                       seed=seed + requests, stop_token_ids=[])
        for ids in res.token_ids:
            digest.update(repr(ids).encode())
        done += res.decode_steps
        requests += 1
        last = engine.runner().last_logits  # the request's last step (one host read per request)
        if last is not None:
            nonfinite += int((~torch.isfinite(last)).sum())
        if requests == 1:
            mem_first = torch.cuda.memory_allocated(engine.device) if on_cuda else 0
            graphs_first = counters["stats"]["unique_graphs"]
    elapsed = time.perf_counter() - t0
    return {"steps": done, "requests": requests, "tokens_per_s": done * batch / elapsed,
            "mem_first_mib": (mem_first or 0) / 2**20,
            "mem_last_mib": (torch.cuda.memory_allocated(engine.device) if on_cuda else 0) / 2**20,
            "mem_peak_mib": (torch.cuda.max_memory_allocated(engine.device) if on_cuda else 0) / 2**20,
            "rss_mib": _rss_mib(), "nonfinite_logits": nonfinite,
            "recompiles": counters["stats"]["unique_graphs"] - graphs_first, "ids_sha256": digest.hexdigest()}


def main(argv=None) -> int:
    from dsv4_model.runtime.cli import default_model_path
    from dsv4_model.runtime.engine import Engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=2)
    a = p.parse_args(argv)
    path = a.model or default_model_path()[0]
    engine = Engine.from_pretrained(path, device=a.device, max_batch_size=a.batch, max_seq_len=a.max_seq_len,
                                    progress=False)
    results = []
    for run in range(a.runs):
        r = soak(engine, a.steps, a.batch, a.seed, a.temperature)
        results.append(r)
        print(f"run {run + 1}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in r.items()), flush=True)
    same = len({r["ids_sha256"] for r in results}) == 1
    flat = all(abs(r["mem_last_mib"] - results[0]["mem_first_mib"]) < 1.0 for r in results)
    ok = same and flat and all(r["nonfinite_logits"] == 0 and r["recompiles"] == 0 for r in results)
    print(f"soak {'OK' if ok else 'FAILED'}: identical ids across runs {same}, device memory flat {flat}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
