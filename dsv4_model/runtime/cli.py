"""`python -m dsv4_model generate ...`: stream a completion and report the decode speed.

Without --model it runs the built-in default model: `dsv4_model/assets/default/` when a trained model is
shipped there, else a random tiny checkpoint written once into a cache directory (its text is gibberish;
it shows the pipeline, not a language model).

Started by `torchrun --nproc-per-node N -m dsv4_model generate ...`, every rank holds 1 / N of the routed experts
(expert parallelism) and generates the same tokens; rank 0 prints.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from dsv4_model.checkpoint.builtin import DEFAULT_MODEL, DEFAULT_MODEL_DIR, RANDOM_TINY_NAME, default_model_path  # noqa: F401


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (and exit 2), like every other failure of the CLI."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def package_version() -> str:
    """The installed dsv4 distribution's version, else the source tree's pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("dsv4")
    except metadata.PackageNotFoundError:
        import tomllib

        with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
            return tomllib.load(f)["project"]["version"]


class _Version(argparse.Action):
    """--version, read only when asked (no import cost for a run)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(f"dsv4 {package_version()}\n")  # stdout, as argparse's own version action
        parser.exit(0)


class _Prompts(argparse.Action):
    """--prompt / --prompt-file: (kind, value) pairs in command-line order."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), (self.const, value)])


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads() -> int:
    """The usable cores less those the machine's 1-minute load average says other jobs keep busy, shared by the
    ranks torchrun started on this host; at least 1."""
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except (AttributeError, OSError):
        busy = 0
    return max(1, (usable_cores() - busy) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m dsv4_model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version, help="print the dsv4 version and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="stream a completion of --prompt")
    # listed here for --help; `python -m dsv4_model serve` goes to dsv4_model.serve.cli before this parser
    sub.add_parser("serve", help="the OpenAI-compatible server (python -m dsv4_model serve --help)", add_help=False)
    g.add_argument("--model", help="checkpoint directory (hf / official / dsv4 layout), or a Hugging Face repo id "
                   "ORG/NAME[@REV] already in the local HF cache; default: the built-in model, also named dsv4-default")
    g.add_argument("--prompt", dest="prompts", action=_Prompts, const="text", metavar="TEXT",
                   help="prompt text, or - to read one prompt from stdin; repeat for a batch (completions are printed "
                        "one after another); bytes that are not UTF-8 are replaced with U+FFFD (said on stderr)")
    g.add_argument("--prompt-file", dest="prompts", action=_Prompts, const="file", metavar="PATH",
                   help="one prompt per file, its whole text (one final newline dropped); repeatable, mixes with "
                        "--prompt in command-line order")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt on stdout (prompt, ids, text, finish_reason, timings), "
                        "nothing else; no streaming")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens per completion at most (default 64)")
    g.add_argument("--n", type=int, default=1, metavar="N",
                   help="completions per prompt (completion j of prompt i samples with seed --seed + i * N + j)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a completion at this text (not printed); repeatable")
    g.add_argument("--max-batch-size", type=int, default=None, metavar="ROWS",
                   help="cache rows: completions generated at once (default: all); more completions flow through "
                        "the rows as they free up")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off (default)")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed (default 0: a sampled run repeats itself; see --n for the seed of each "
                        "completion)")
    g.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="draft K tokens per step and verify them in one pass (0 = off; at most 8: "
                        "docs/speculation.md)")
    g.add_argument("--speculate-method", choices=("auto", "mtp", "dspark"), default="auto",
                   help="the drafter: the MTP block, or the DSpark module of a V4-Flash-0731-style checkpoint "
                        "(docs/dspark.md); auto: DSpark when the checkpoint carries it")
    add_dspark_args(g)
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decode step (default: on for CUDA)")
    g.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=False,
                   help="prefill chunks through compiled graphs per (rows, tokens) bucket, each compiled on first "
                        "use (default: off; docs/architecture.md, \"Compiled prefill\")")
    g.add_argument("--regional-compile", action="store_true",
                   help="compile one decoder layer at a time, reused by the layers that trace the same (compile "
                        "time grows with the kinds of layers, not the depth): decode steps, and prefill chunks with "
                        "--compile-prefill; implies --compile (also on the CPU)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the decode step as CUDA graphs (default: on for CUDA; CUDA only)")
    g.add_argument("--graph-mode", choices=("manual", "reduce-overhead"), default=None,
                   help="how the CUDA graphs are captured (default manual; CUDA graphs only)")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="activations, caches and float weights (default bfloat16)")
    g.add_argument("--max-seq-len", type=int, default=None,
                   help="cache length (default: longest prompt + max-new-tokens, rounded up to 256, at most the "
                        "model's max_position_embeddings); a completion that reaches it is cut short (said on stderr)")
    g.add_argument("--allow-beyond-max-position", action="store_true",
                   help="let --max-seq-len exceed the model's max_position_embeddings (positions it was not "
                        "trained for)")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="positions per prefill forward: a longer prompt is prefilled in chunks (default 8192)")
    g.add_argument("--no-simulate-quant", action="store_true", help="skip the KV/indexer fake quantization")
    g.add_argument("--quant", choices=("auto", "nvfp4", "none"), default="auto",
                   help="weights: nvfp4 (dsv4 NVFP4 kernels) or none (float); auto = as stored on CUDA, float on "
                        "CPU (the CPU NVFP4 kernels are exact references that dequantize per call, ~3x slower)")
    g.add_argument("--head-quant", choices=("none", "nvfp4"), default="none",  # Engine.from_pretrained's
                   help="the head: as stored (none), or NVFP4 after loading (a quarter of its bytes per step; the greedy "
                        "token changes at ~5%% of the built-in model's positions; docs/nvfp4.md)")
    g.add_argument("--act-quant", choices=("none", "nvfp4"), default=None,
                   help="nvfp4 = W4A4 (activations quantized per token too); default: as stored, else none")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU intra-op threads, at most the cores this process may use (default: those cores less "
                        "the machine's 1-minute load average, rounded, at least 1)")
    g.add_argument("--debug", action="store_true", help="on an error, show the traceback too")
    return p


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


_QUIET = [False]  # a torchrun rank other than 0: notes are rank 0's to print
_STREAMED = [False]  # text on stdout without its final newline yet (a Ctrl-C then ends the line)


def _note(msg: str) -> None:
    if not _QUIET[0]:
        print(f"[dsv4] {msg}", file=sys.stderr, flush=True)


def check_threads_fit(threads: int) -> None:
    """--threads (generate and serve) at most the cores this process may use."""
    if threads > usable_cores():
        raise ValueError(f"--threads {threads}: this process may use {usable_cores()} cores "
                         "(more threads than cores only contend)")


def check_model_arg(model: str | None) -> None:
    """--model given but empty (an unset shell variable) is a mistake, not a request for the built-in model."""
    if model is not None and not model.strip():
        raise ValueError("--model: empty (leave --model out for the built-in model)")


def _check_args(args) -> None:
    """Everything the arguments alone decide, before any file is read."""
    from dsv4_model.model.checks import check_positive_int, check_speculate
    from dsv4_model.runtime.sampling import SamplingParams

    check_model_arg(args.model)
    if not args.prompts:
        raise ValueError("no prompt: give --prompt TEXT, --prompt - (stdin) or --prompt-file PATH")
    if sum(v == "-" for kind, v in args.prompts if kind == "text") > 1:
        raise ValueError("--prompt -: stdin holds one prompt, give it once")
    check_positive_int(args.max_new_tokens, "--max-new-tokens")
    check_positive_int(args.n, "--n")
    if args.max_batch_size is not None:
        check_positive_int(args.max_batch_size, "--max-batch-size")
    if any(not s for s in args.stop):
        raise ValueError("--stop: a stop string must not be empty")
    check_speculate(args.speculate, "--speculate")
    check_drafter_args(args)
    if args.max_seq_len is not None:
        check_positive_int(args.max_seq_len, "--max-seq-len")
    if args.threads is not None:
        check_positive_int(args.threads, "--threads")
        check_threads_fit(args.threads)
    check_regional_args(args)
    if args.graph_mode is not None and args.cuda_graphs is False:
        raise ValueError("--graph-mode picks how CUDA graphs are captured: it contradicts --no-cuda-graphs")
    if args.regional_compile and args.graph_mode == "reduce-overhead":
        raise ValueError("--regional-compile captures manual CUDA graphs: it contradicts --graph-mode reduce-overhead")
    if args.prefill_chunk is not None:
        check_positive_int(args.prefill_chunk, "--prefill-chunk")
    if args.act_quant == "nvfp4" and args.quant == "none":
        raise ValueError("--act-quant nvfp4 quantizes activations for NVFP4 weights (W4A4): it contradicts --quant none")
    try:
        SamplingParams(args.temperature, args.top_k, args.top_p, args.seed).validate()
    except ValueError as e:
        raise ValueError(f"--{e}".replace("_", "-", 1)) from None


def _check_device_args(args, device) -> None:
    """Options that only mean something on a GPU, refused on the CPU rather than ignored."""
    if device.type == "cuda":
        return
    if args.cuda_graphs:
        raise ValueError(f"--cuda-graphs: CUDA graphs need a CUDA device, this run is on {device}")
    if args.graph_mode is not None:
        raise ValueError(f"--graph-mode picks how CUDA graphs are captured: there are none on {device}")


def _prompt_text(arg: str, i: int) -> str:
    """A --prompt as text: bytes the shell passed that are not UTF-8 (they reach Python as surrogates) become
    U+FFFD, and stderr says so."""
    raw = arg.encode("utf-8", "surrogateescape")
    text = raw.decode("utf-8", "replace")
    if text != arg:
        _note(f"--prompt #{i + 1} is not valid UTF-8: its undecodable bytes were replaced with U+FFFD")
    return text


def _prompt_arg(items, i: int) -> str:
    """How the command line gave prompt i, for an error about it."""
    kind, value = items[i]
    if kind == "file":
        return f"--prompt-file {value}"
    return "--prompt - (stdin)" if value == "-" else ("--prompt" if len(items) == 1 else f"--prompt #{i + 1}")


def _read_prompts(items) -> list[str]:
    """The prompts of --prompt TEXT / --prompt - (stdin) / --prompt-file PATH, in command-line order."""
    out = []
    for i, (kind, value) in enumerate(items):
        if kind == "text" and value != "-":
            out.append(_prompt_text(value, i))
            continue
        what = _prompt_arg(items, i)
        if kind == "text" and sys.stdin is None:
            raise ValueError(f"{what}: this process has no stdin (it was closed)")
        try:
            raw = sys.stdin.buffer.read() if kind == "text" else Path(value).read_bytes()
        except OSError as e:
            raise ValueError(f"{what}: cannot read: {e.strerror or e}") from None
        text = raw.decode("utf-8", "replace")
        if "\ufffd" in text and b"\xef\xbf\xbd" not in raw:
            _note(f"{what} is not valid UTF-8: its undecodable bytes were replaced with U+FFFD")
        text = text[:-1] if text.endswith("\n") else text  # the newline editors and `echo` add
        if not text:
            raise ValueError(f"{what}: empty prompt")
        out.append(text)
    return out


def _cache_len(args, config, prompt_ids) -> int:
    """The cache length: --max-seq-len (checked), else the longest prompt + --max-new-tokens rounded up to 256,
    kept within the model's max_position_embeddings (the completion is then cut short, and says so)."""
    from dsv4_model.model.checks import check_max_seq_len

    longest = max(len(p) for p in prompt_ids)
    limit = None if args.allow_beyond_max_position else config.max_position_embeddings
    if args.max_seq_len is not None:
        check_max_seq_len(args.max_seq_len, config, args.allow_beyond_max_position, "--max-seq-len")
        n = args.max_seq_len
    else:
        # a speculative step may write 2K positions past its row's
        n = max(_round_up(longest + args.max_new_tokens + 2 * args.speculate, 256), max(config.compress_ratios))
        if limit is not None and n > limit:
            n = max(limit, max(config.compress_ratios))
    if longest > n:
        what = "--max-seq-len" if args.max_seq_len is not None else "the model's max_position_embeddings"
        at = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i])) // args.n
        raise ValueError(f"{_prompt_arg(args.prompts, at)} of {longest} tokens does not fit {what} ({n} positions)")
    return n


def check_dspark_cut(cut: float) -> None:
    if not 0.0 <= cut <= 1.0:
        raise ValueError(f"--dspark-cut must be a chance in [0, 1] (0 = off), got {cut}")


def add_dspark_args(group) -> None:
    """--drafter / --dspark-cut / --draft-head (generate and serve)."""
    group.add_argument("--drafter", default=None, metavar="DIR",
                       help="draft with the DSpark module in DIR (scripts/train_dspark.py's output) instead of the "
                            "checkpoint's own drafter (needs --speculate; docs/dspark.md)")
    group.add_argument("--dspark-cut", type=float, default=0.0, metavar="P",
                       help="DSpark: cut each block before its first draft predicted below P (the confidence head's "
                            "chance of acceptance; fewer experts read per step; 0 = off; docs/dspark.md)")
    group.add_argument("--draft-head", choices=("stored", "nvfp4"), default="stored",  # Engine.set_draft_head's
                       help="the head the drafts read: the model's (stored), or an NVFP4 copy of it (a quarter of "
                            "its bytes per speculative step; the output is unchanged, the acceptance may drop; "
                            "docs/speculation.md)")


def _drafters_to_load(speculate: int, drafter: str | None = None) -> dict:
    """Loader options: the checkpoint's drafter (its MTP block or DSpark module; Flash-0731's DSpark holds 10.6 GiB
    in NVFP4 on one GPU, docs/memory.md), or the --drafter directory's, loaded only where --speculate will use
    it."""
    if not speculate:
        return {"load_mtp": False, "load_dspark": False}
    return {"drafter": drafter} if drafter else {}


def check_regional_args(args) -> None:
    """--regional-compile against --compile and --speculate (generate and serve)."""
    if args.regional_compile and args.compile is False:
        raise ValueError("--regional-compile compiles: it contradicts --no-compile")
    if args.regional_compile and args.speculate:
        raise ValueError("--regional-compile: speculative steps compile whole (leave it out with --speculate)")


def check_drafter_args(args) -> None:
    """--drafter against the other speculation options, before any file is read."""
    if args.drafter and not args.speculate:
        raise ValueError("--drafter: the DSpark module drafts for speculative decoding: it needs --speculate K")
    if getattr(args, "draft_head", "stored") != "stored" and not args.speculate:
        raise ValueError(f"--draft-head {args.draft_head}: the drafters' head is speculative decoding's: it needs "
                         "--speculate K")
    if getattr(args, "speculate_method", "auto") != "auto" and not args.speculate:
        raise ValueError(f"--speculate-method {args.speculate_method}: picks the drafter of speculative decoding: "
                         "it needs --speculate K")
    if args.drafter and getattr(args, "speculate_method", "auto") == "mtp":
        raise ValueError("--drafter holds a DSpark module: it contradicts --speculate-method mtp")


def config_with_drafter(config, args):
    """The checkpoint's config as the engine will be built: with --drafter's DSpark module when given."""
    if not (args.drafter and args.speculate):
        return config
    from dsv4_model.checkpoint.drafter import with_drafter

    return with_drafter(config, args.drafter)


def _check_speculate_method(args, config, path) -> None:
    """--speculate-method / --dspark-cut against the checkpoint's config, before any weight is read."""
    check_dspark_cut(args.dspark_cut)
    method = args.speculate_method
    if method == "auto":
        method = "dspark" if config.dspark is not None else "mtp"
    if args.dspark_cut and (not args.speculate or method != "dspark"):
        raise ValueError("--dspark-cut: the confidence cut is DSpark's: it needs --speculate K on a checkpoint "
                         "with a DSpark module")
    if args.speculate and method == "mtp" and not args.drafter:
        check_mtp_block(config, path)
    if not args.speculate or method != "dspark":
        return
    if config.dspark is None:
        raise ValueError(f"--speculate-method dspark: {path} carries no DSpark module (a V4-Flash-0731-style "
                         "checkpoint does: docs/dspark.md)")
    if args.speculate > config.dspark.block_size:
        raise ValueError(f"--speculate {args.speculate}: DSpark drafts blocks of {config.dspark.block_size} tokens "
                         f"(--speculate 1..{config.dspark.block_size})")
    from dsv4_model.checkpoint.loader import _has_mtp, list_tensors

    if not args.drafter and not _has_mtp(list_tensors(Path(path))):
        raise ValueError(f"--speculate: {path}'s config describes a DSpark module (dspark_* keys), but it has none of "
                         "its tensors (no mtp.*): a download that left them out? (docs/dspark.md)")


def check_mtp_block(config, path) -> None:
    """MTP speculation needs an MTP block the checkpoint carries: decided from its config and tensor names (the
    shard headers), not after minutes of loading."""
    from dsv4_model.checkpoint.loader import _has_mtp, list_tensors

    if config.dspark is not None:
        raise ValueError(f"--speculate-method mtp: {path} carries a DSpark module (mtp.* tensors, dspark_* config "
                         "keys), not an MTP block: leave --speculate-method at auto or dspark (docs/dspark.md)")
    has_mtp = _has_mtp(list_tensors(Path(path)))  # the loader's own test
    if not (config.n_mtp_layers and has_mtp):
        why = "no mtp.* tensors" if config.n_mtp_layers else "num_nextn_predict_layers = 0 in its config"
        raise ValueError(f"--speculate: {path} has no MTP block to draft with ({why}); a checkpoint with one, or a "
                         "DSpark drafter (--drafter DIR), can speculate (docs/speculation.md)")


def cmd_generate(args) -> int:
    _check_args(args)
    import torch

    from dsv4_model.model.checks import parse_device
    from dsv4_model.runtime.engine import Engine
    from dsv4_model.runtime import distributed
    from dsv4_model.runtime.session import RunnerOptions
    from dsv4_model.runtime.generate import generate, speculate_method_of
    from dsv4_model.checkpoint.loader import load_config
    from dsv4_model.checkpoint.tokenizer import load_tokenizer

    device = parse_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shard = None
    if distributed.launched():
        device, shard = distributed.init_expert_parallel(device)
        if shard.rank:
            _QUIET[0] = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # rank 0 streams the text
    _check_device_args(args, device)
    prompts = _read_prompts(args.prompts)
    if args.model is not None:
        from dsv4_model.checkpoint.hub import resolve_checkpoint

        path = resolve_checkpoint(args.model, "--model")
    else:
        path, what = default_model_path()
        _note(what)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or default_threads())
    quant = args.quant if args.quant != "auto" else (None if device.type == "cuda" else "none")
    if args.act_quant == "nvfp4" and args.quant == "auto":  # W4A4 needs NVFP4 weights: auto gets them (CPU or GPU)
        quant = "nvfp4"
    config = config_with_drafter(load_config(path), args)
    _check_speculate_method(args, config, path)
    if shard is not None:
        shard.bounds(config.n_routed_experts)  # the experts must split evenly over the ranks
    tok = load_tokenizer(path, config)
    if tok.kind == "bytes":
        _note(f"{path} has no tokenizer.json: using the byte-level fallback tokenizer")
    prompts = [p for p in prompts for _ in range(args.n)]  # completion j of prompt i at i * n + j
    prompt_ids = [tok.encode(p) for p in prompts]
    max_seq_len = _cache_len(args, config, prompt_ids)
    rows = min(len(prompt_ids), args.max_batch_size or len(prompt_ids))
    t0 = time.perf_counter()
    runner = RunnerOptions(compile=True if args.regional_compile else args.compile, cuda_graphs=args.cuda_graphs,
                           graph_mode=args.graph_mode or "manual", regional=args.regional_compile, log=_note)
    engine = Engine.from_pretrained(path, device=device, dtype=getattr(torch, args.dtype),
                                    max_batch_size=rows, max_seq_len=max_seq_len,
                                    simulate_quant=not args.no_simulate_quant, runner_options=runner, quant=quant,
                                    act_quant=args.act_quant, allow_beyond_max_position=args.allow_beyond_max_position,
                                    expert_shard=shard, progress=not _QUIET[0],
                                    spare_window_slots=args.speculate, compile_prefill=args.compile_prefill,
                                    head_quant=args.head_quant,
                                    **_drafters_to_load(args.speculate, args.drafter),
                                    **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}))
    if args.speculate and args.draft_head != "stored":
        engine.set_draft_head(args.draft_head)
    t_load = time.perf_counter() - t0

    single = len(prompt_ids) == 1 and not args.json
    t1 = time.perf_counter()
    method = speculate_method_of(engine, args.speculate_method) if args.speculate else None
    if method == "dspark":  # compile / capture before any text is printed
        engine.dspark_runner(args.speculate, cut=args.dspark_cut).prepare(rows)
    elif args.speculate:
        from dsv4_model.runtime.sampling import SamplingParams
        from dsv4_model.runtime.speculative import sampling_mode

        mode = sampling_mode([SamplingParams(args.temperature, args.top_k, args.top_p)])
        engine.speculative_runner(args.speculate).prepare(rows, mode)
    else:  # every bucket the scheduler may step in, as it shrinks (it prepares them too; here they are timed apart)
        dr = engine.runner()
        dr.prepare_all([b for b in dr.buckets if b <= dr.bucket(rows)])
    t_setup = time.perf_counter() - t1
    if single:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
        _STREAMED[0] = True

    def on_token(row, token_id, text):
        if single and text:
            sys.stdout.write(text)
            sys.stdout.flush()

    res = generate(engine, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stream=on_token, tokenizer=tok,
                   speculate=args.speculate, stop=args.stop, speculate_method=args.speculate_method,
                   dspark_cut=args.dspark_cut)
    if args.json:
        timings = {k: round(v, 6) for k, v in (("load_s", t_load), ("setup_s", t_setup),
                                                ("prefill_s", res.prefill_seconds), ("decode_s", res.decode_seconds),
                                                ("decode_tokens_per_s", res.decode_tokens_per_s))}  # of the batch
        for i, (prompt, ids_in, ids, text, why) in enumerate(zip(prompts, prompt_ids, res.token_ids, res.texts,
                                                                 res.finish_reasons)):
            sys.stdout.write(json.dumps({"prompt": prompt, "index": i // args.n, "sample": i % args.n,
                                         "prompt_ids": ids_in, "ids": ids, "text": text, "finish_reason": why,
                                         "timings": timings}, ensure_ascii=False) + "\n")
    elif single:
        sys.stdout.write("\n")
        _STREAMED[0] = False
    else:
        for prompt, text in zip(prompts, res.texts):
            sys.stdout.write(f"--- {prompt!r}\n{prompt}{text}\n")
    sys.stdout.flush()
    for i, (why, ids) in enumerate(zip(res.finish_reasons, res.token_ids)):
        if why == "max_seq_len":
            _note(f"completion {i + 1} cut short after {len(ids)} of {args.max_new_tokens} tokens: the caches hold "
                  f"max_seq_len={max_seq_len} positions ({_raise_hint(args, config, max_seq_len)})")
    n = res.num_generated
    total = res.prefill_seconds + res.decode_seconds
    _note(f"{n} tokens in {total:.2f} s = {n / total if total else 0:.1f} tokens/s "
          f"(decode {res.decode_tokens_per_s:.1f} tokens/s, {res.ms_per_step:.2f} ms/step at batch "
          f"{rows}; first token {1e3 * res.prefill_seconds:.0f} ms; mode {res.mode} on {device}; "
          f"not counted: load {t_load:.1f} s, compile/capture {t_setup:.1f} s)"
          + (f"; expert parallel over {shard.world} ranks" if shard is not None else ""))
    spec = res.extra.get("speculation")
    if spec is not None:
        # a position no row reached (earlier drafts rejected, or the run ended) has no rate: "-", not nan%
        def rates(values):
            return " / ".join("-" if math.isnan(a) else f"{100 * a:.1f}%" for a in values)

        _note(f"speculation: {spec.tokens_per_step:.2f} tokens per step; drafts accepted per position "
              + rates(spec.acceptance())
              + (f" (the confidence head predicted {rates(spec.predicted_acceptance())})" if spec.predicted_rows
                 else ""))
    return 0


def _raise_hint(args, config, max_seq_len: int) -> str:
    """What lets a completion run longer: a larger --max-seq-len while it stays within the positions the model
    was trained for, else only --allow-beyond-max-position."""
    if max_seq_len < config.max_position_embeddings or args.allow_beyond_max_position:
        return "raise --max-seq-len"
    return (f"the model's max_position_embeddings={config.max_position_embeddings}; --allow-beyond-max-position "
            "with a larger --max-seq-len runs past it, on positions it was not trained for")


def run_cli(fn, args, errors: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError)) -> int:
    """fn(args) with the CLI conventions: an expected error (bad checkpoint, argument or input) is one line on
    stderr and exit code 2 (args.debug: the traceback too); a reader that goes away (`| head`) ends the
    command quietly with the status a SIGPIPE would give."""
    try:
        return fn(args)
    except KeyboardInterrupt:
        if getattr(args, "debug", False):
            raise
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C during clean-up ends it at once, silently
        return _interrupted()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141
    except errors as e:
        if getattr(args, "debug", False):
            raise
        sys.stderr.write(f"error: {e}\n")  # one write: torchrun's ranks share the stream
        sys.stderr.flush()
        return 2
    except (MemoryError, RuntimeError) as e:  # an allocation the memory check did not foresee
        if getattr(args, "debug", False) or not _out_of_memory(e):
            raise
        first = (str(e).splitlines() or [type(e).__name__])[0]
        sys.stderr.write(f"error: out of memory: {first} (lower --max-seq-len / --max-batch-size, "
                         "or use a smaller model)\n")
        return 2


def _out_of_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def _interrupted() -> int:
    """Ctrl-C: the text streamed so far ends its line, one line on stderr, the shell's 128 + SIGINT."""
    try:
        sys.stdout.write("\n" if _STREAMED[0] else "")
        sys.stdout.flush()
    except (OSError, ValueError):  # the reader went away too, or stdout is closed
        pass
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    return 130


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
    except KeyboardInterrupt:
        return _interrupted()
    try:
        return run_cli(cmd_generate, args)
    finally:
        dist_mod = sys.modules.get("dsv4_model.runtime.distributed")  # imported only by a run that got that far
        if dist_mod is not None:
            dist_mod.shutdown()
