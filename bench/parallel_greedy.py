"""The same random NVFP4 model on one GPU and on several (expert parallel): do they give the same greedy tokens?
Issue #32's correctness check at real widths (43 layers, fewer experts so that one GPU holds them).

    python bench/parallel_greedy.py --layers 43 --experts 32 --out one.pt                            # one GPU
    torchrun --nproc-per-node 2 bench/parallel_greedy.py --layers 43 --experts 32 --out two.pt       # two
    python bench/parallel_greedy.py --compare one.pt two.pt

Each run builds `random_nvfp4_model` with the same seed (an expert-parallel rank holds exactly its slice of the
one-process model's experts: tests/test_random_model.py), prefills --batch random prompts of different lengths
and decodes --steps greedy tokens through the decode runner (compiled + CUDA graphs on a GPU, eager on the CPU);
rank 0 saves the tokens and every step's logits. --compare prints whether the tokens are equal (else the first
step and row where they part) and the logits' largest difference against the bf16 tolerance the tests use
(expert parallelism exchanges each assignment's output row, zero where another rank owns the expert, and combines
them in slot order: equal bit for bit is expected).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import FULL_MODELS as PRESETS  # noqa: E402
from dsv4_model.quant.random_model import random_nvfp4_model  # noqa: E402
from dsv4_model.runtime import distributed  # noqa: E402
from dsv4_model.runtime.compiled import DecodeRunner  # noqa: E402
from dsv4_model.runtime.sampling import SamplingParams  # noqa: E402

BF16_ATOL = BF16_RTOL = 2e-2  # the tests' bf16 logits tolerance (tests/test_nvfp4_model.py)


def run(args) -> dict:
    device = torch.device(args.device)
    shard = None
    if distributed.launched():
        device, shard = distributed.init_expert_parallel(device)
    distributed.untimed_kernels()  # one GPU too: the same kernel choices as the expert-parallel run's
    cuda = device.type == "cuda"
    cfg = PRESETS[args.preset]().sliced(args.layers, n_routed_experts=args.experts, n_mtp_layers=0)
    max_seq = args.prompt_len + args.steps + 8
    model = random_nvfp4_model(cfg, device=device, max_batch_size=args.batch, max_seq_len=max_seq, seed=args.seed,
                               expert_shard=shard)
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [args.prompt_len - 7 * b for b in range(args.batch)]  # ragged: rows at different positions
    if min(lengths) < 1:
        raise SystemExit(f"--prompt-len {args.prompt_len}: too short for {args.batch} ragged rows")
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen).to(device)
    runner = DecodeRunner(model, compile=cuda, cuda_graphs=cuda)
    runner.prepare(args.batch)
    model.reset_caches()
    with torch.no_grad():
        first = model.prefill(ids, torch.tensor(lengths, device=device))
        runner.begin(lengths, [SamplingParams() for _ in range(args.batch)])
        logits, tokens = [first.float().cpu()], [runner.sample_first(first).cpu()]
        for _ in range(args.steps):
            lg, nxt = runner.step()
            logits.append(lg.float().cpu())
            tokens.append(nxt.cpu())
    world = 1 if shard is None else shard.world
    return {"tokens": torch.stack(tokens, 1), "logits": torch.stack(logits, 1), "world": world,
            "config": f"{args.preset} {cfg.n_layers} layers, {cfg.n_routed_experts} experts, seed {args.seed}",
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "rank0": shard is None or shard.rank == 0}


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    if a["config"] != b["config"] or a["tokens"].shape != b["tokens"].shape:
        print(f"not the same run: {a['config']} {tuple(a['tokens'].shape)} vs {b['config']} {tuple(b['tokens'].shape)}")
        return 2
    ta, tb = a["tokens"], b["tokens"]
    same = torch.equal(ta, tb)
    where = ""
    if not same:
        steps = (ta != tb).any(0).nonzero()
        s = int(steps[0])
        where = f" (first difference at step {s}: rows {(ta[:, s] != tb[:, s]).nonzero().flatten().tolist()})"
    # logits compared up to the first differing token (after it the rows decode different sequences)
    n = ta.shape[1] if same else int((ta != tb).any(0).nonzero()[0]) + 1
    la, lb = a["logits"][:, :n], b["logits"][:, :n]
    diff = float((la - lb).abs().max())
    close = torch.allclose(la, lb, atol=BF16_ATOL, rtol=BF16_RTOL)
    print(f"{a['config']}: world {a['world']} ({a['device']}) vs {b['world']} ({b['device']}), "
          f"{ta.shape[0]} rows x {ta.shape[1]} greedy tokens")
    verdict = "bit for bit" if diff == 0 else \
        f"{'within' if close else 'OUTSIDE'} the bf16 tolerance atol = rtol = {BF16_ATOL}"
    print(f"tokens equal: {'yes' if same else 'NO'}{where}; logits max |diff| {diff:.3g} over {n} steps ({verdict})")
    return 0 if same and close else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved runs")
    ap.add_argument("--preset", choices=tuple(PRESETS), default="flash")
    ap.add_argument("--layers", type=int, default=None, help="default: the preset's")
    ap.add_argument("--experts", type=int, default=32, help="routed experts in all (a multiple of the ranks)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="where rank 0 saves the tokens and logits")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out PATH (or --compare A B)")
    res = run(args)
    if res.pop("rank0"):
        torch.save(res, args.out)
        print(f"{res['config']}: world {res['world']}, tokens {res['tokens'].tolist()}", flush=True)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    distributed.run_main(main)
