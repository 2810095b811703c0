"""CLI: build / run / inspect dsv4 AOTInductor packages.

    python -m dsv4_export build --model CKPT_DIR --out model.pt2 [--max-batch-size 4] [--max-seq-len 4096]
                           [--device cuda] [--dtype bfloat16] [--decode-batches 1,2,4] [--prefill-batches 1]
                           [--prefill-lengths 64,256] [--prefill-chunks 4096] [--quant nvfp4] [--act-quant nvfp4]
                           [--no-simulate-quant] [--no-exported-programs] [--jobs N] [--head-quant nvfp4]
    python -m dsv4_export run model.pt2 (--prompt TEXT | --prompt-ids 1 2 3) [--max-new-tokens 16] [--temperature 0]
                           [--no-cuda-graphs]
    python -m dsv4_export info model.pt2
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _parser() -> argparse.ArgumentParser:
    from dsv4_model.runtime.cli import _Parser, _Version

    ap = _Parser(prog="python -m dsv4_export", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action=_Version, help="print the dsv4 version and exit")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    b = sub.add_parser("build", help="export prefill + decode and compile them into one .pt2")
    b.add_argument("--model", required=True, help="checkpoint directory (any layout dsv4_model.checkpoint.loader "
                   "reads), or a Hugging Face repo id ORG/NAME[@REV] in the local HF cache")
    b.add_argument("--out", required=True, help="package path, must end in .pt2")
    b.add_argument("--max-batch-size", type=int, default=1)
    b.add_argument("--max-seq-len", type=int, default=4096)
    b.add_argument("--allow-beyond-max-position", action="store_true",
                   help="let --max-seq-len exceed the model's max_position_embeddings")
    b.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    b.add_argument("--decode-batches", type=_ints, default=None,
                   help="decode batch buckets (default: 1, 2, 4, ... up to max-batch-size)")
    b.add_argument("--prefill-batches", type=_ints, default=None,
                   help="prefill batch buckets (default: 1 and max-batch-size)")
    b.add_argument("--prefill-lengths", type=_ints, default=None,
                   help="prefill length buckets (default: 64, 256, 1024, ... and max-seq-len)")
    b.add_argument("--prefill-chunks", type=_ints, default=None,
                   help="chunk lengths of prefill_chunk entries: a prompt longer than every prefill length runs in "
                        "chunks (then give --prefill-lengths up to the chunk: no giant max-seq-len bucket)")
    b.add_argument("--no-simulate-quant", action="store_true", help="build the model without simulated quant")
    b.add_argument("--quant", choices=["none", "nvfp4"], default=None,
                   help="weights: nvfp4 converts at load (default: as the checkpoint stores them)")
    b.add_argument("--act-quant", choices=["none", "nvfp4"], default=None, help="NVFP4 activations (W4A4)")
    b.add_argument("--head-quant", choices=["none", "nvfp4"], default="none",
                   help="the head in NVFP4 (a quarter of its bytes per step; an accuracy trade: docs/nvfp4.md)")
    b.add_argument("--jobs", type=int, default=None,
                   help="processes that export + compile the entries side by side (default: one per 3 CPU cores, "
                        "as memory allows)")
    b.add_argument("--no-exported-programs", action="store_true",
                   help="do not also save <out>.<entry>.ep.pt2 (torch.export.save)")

    r = sub.add_parser("run", help="load a package in this process and generate")
    r.add_argument("package")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT",
                     help="prompt text, encoded with the tokenizer the package carries; prints the text")
    src.add_argument("--prompt-ids", type=int, nargs="+", help="prompt token ids; prints the generated ids")
    r.add_argument("--max-new-tokens", type=int, default=16)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default=None, help="default: the device the package was built for")
    # --no-cuda-graphs as in `python -m dsv4_model`; the singular kept for the scripts that used it
    r.add_argument("--no-cuda-graphs", "--no-cuda-graph", dest="no_cuda_graph", action="store_true",
                   help="do not replay decode in CUDA graphs")

    i = sub.add_parser("info", help="print a package's metadata (without loading it)")
    i.add_argument("package")
    for p in (b, r, i):
        p.add_argument("--debug", action="store_true", help="on an error, show the traceback too")
    return ap


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: the build removes its partial files


def _build(a) -> int:
    import signal

    import torch

    from dsv4_export.build import build_from_checkpoint, plan_build

    from dsv4_model.runtime.compiled import batch_buckets

    from dsv4_model.model.checks import check_positive_int, parse_device

    check_positive_int(a.max_batch_size, "--max-batch-size")
    check_positive_int(a.max_seq_len, "--max-seq-len")
    if a.jobs is not None:
        check_positive_int(a.jobs, "--jobs")
    decode_batches = a.decode_batches or batch_buckets(a.max_batch_size)
    prefill_batches = a.prefill_batches or sorted({1, a.max_batch_size})
    # --out and the buckets, named by their flags, before the checkpoint is read
    plan_build(a.out, max_batch_size=a.max_batch_size, max_seq_len=a.max_seq_len, decode_batches=decode_batches,
               prefill_batches=prefill_batches, prefill_lengths=a.prefill_lengths,
               prefill_chunks=a.prefill_chunks or (), flags=True)
    device = str(parse_device(a.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    t0 = time.time()
    signal.signal(signal.SIGTERM, _terminated)
    build_from_checkpoint(a.model, a.out, max_batch_size=a.max_batch_size, max_seq_len=a.max_seq_len, device=device,
                          dtype=getattr(torch, a.dtype), simulate_quant=not a.no_simulate_quant,
                          quant=a.quant, act_quant=a.act_quant, decode_batches=decode_batches,
                          prefill_batches=prefill_batches, prefill_lengths=a.prefill_lengths,
                          save_exported_programs=not a.no_exported_programs,
                          allow_beyond_max_position=a.allow_beyond_max_position, jobs=a.jobs,
                          prefill_chunks=a.prefill_chunks or (), head_quant=a.head_quant)
    print(f"[export] done in {time.time() - t0:.0f} s: {a.out}", file=sys.stderr)
    return 0


def _run(a) -> int:
    from dsv4_model.model.checks import check_positive_int, parse_device
    from dsv4_model.runtime.sampling import SamplingParams
    from dsv4_export import metadata as md
    from dsv4_export.load import ExportedEngine

    check_positive_int(a.max_new_tokens, "--max-new-tokens")
    if a.device is not None:
        parse_device(a.device)  # one line, as build's --device, not a traceback from torch.device
    try:
        SamplingParams(a.temperature, a.top_k, a.top_p, a.seed).validate()
    except ValueError as e:
        raise ValueError(f"--{e}".replace("_", "-", 1)) from None
    t0 = time.time()
    eng = ExportedEngine(a.package, device=a.device, cuda_graph=False if a.no_cuda_graph else None)
    print(f"[export] loaded {a.package} ({', '.join(eng.entries)}) on {eng.device} in {time.time() - t0:.1f} s",
          file=sys.stderr)
    if a.prompt is not None and md.K_TOKENIZER not in eng.metadata:
        raise ValueError(f"{a.package} carries no tokenizer (built before packages did): pass --prompt-ids, or "
                         "rebuild it")
    prompt = a.prompt if a.prompt is not None else a.prompt_ids
    res = eng.generate([prompt], max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                       top_p=a.top_p, seed=a.seed)
    if a.prompt is not None:
        print(a.prompt + res.texts[0])
    else:
        print("generated:", " ".join(map(str, res.token_ids[0])))
    if res.finish_reasons[0] == "max_seq_len":
        print(f"[export] cut short after {len(res.token_ids[0])} of {a.max_new_tokens} tokens: the package's caches "
              f"hold max_seq_len={eng.max_seq_len} positions", file=sys.stderr)
    print(f"[export] {res.finish_reasons[0]}; prefill {1e3 * res.prefill_seconds:.1f} ms, decode "
          f"{res.ms_per_step:.2f} ms/step ({'package + CUDA graphs' if eng.cuda_graph else 'package'})",
          file=sys.stderr)
    return 0


def _info(a) -> int:
    from dsv4_export.load import get_metadata

    meta = get_metadata(a.package)
    for k in sorted(meta):
        v = meta[k]
        if k in ("dsv4.config", "dsv4.entries", "dsv4.caches", "dsv4.ops_used", "dsv4.quant_info"):
            v = json.dumps(json.loads(v), sort_keys=True)
        print(f"{k} = {v}")
    return 0


def main(argv=None) -> int:
    from dsv4_model.runtime.cli import _interrupted, run_cli

    try:
        a = _parser().parse_args(argv)
        from dsv4_export.metadata import PackageMismatch
        from dsv4_export.toolchain import ToolchainError
    except KeyboardInterrupt:  # Ctrl-C while torch imports: no traceback either
        return _interrupted()
    return run_cli({"build": _build, "run": _run, "info": _info}[a.cmd], a,
                   (PackageMismatch, ToolchainError, OSError, ValueError, ImportError))


if __name__ == "__main__":
    raise SystemExit(main())
