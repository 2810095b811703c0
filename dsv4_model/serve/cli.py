"""`python -m dsv4_model serve ...`: the OpenAI-compatible server (docs/serving.md).

Loads the model, builds the scheduler, serves the app with uvicorn. SIGTERM / SIGINT: the listening socket
closes, running requests get --drain-timeout seconds to finish, the rest are cancelled, exit 0."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

SPECULATE_MODES = ("greedy", "filter")  # --speculate: steps prepared for greedy and for sampled requests


class _Help(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; an option's default after its help where it has one to say."""

    def _get_help_string(self, action):
        h = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in h:
            h += " (default: %(default)s)"
        return h


DEFAULT_MAX_SEQ_LEN = 4096


def _parser() -> argparse.ArgumentParser:
    from dsv4_model.runtime.cli import _Parser, add_dspark_args

    p = _Parser(prog="python -m dsv4_model serve", description=__doc__, formatter_class=_Help)
    p.add_argument("--model", help="checkpoint directory or ORG/NAME[@REV] in the local HF cache; default: built-in")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: --model as given for a repo id, else the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the line on stderr says which)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activations and caches")
    p.add_argument("--quant", choices=("auto", "nvfp4", "none"), default="auto",
                   help="weights: as stored on CUDA, float on the CPU (auto), or forced")
    p.add_argument("--head-quant", choices=("none", "nvfp4"), default="none",
                   help="the head: as stored (none), or NVFP4 after loading (a quarter of its bytes per step; the greedy "
                        "token changes at ~5%% of the built-in model's positions; docs/nvfp4.md)")
    p.add_argument("--act-quant", choices=("none", "nvfp4"), default=None,
                   help="nvfp4 = W4A4 (activations quantized per token too); default: as stored, else none")
    p.add_argument("--no-simulate-quant", action="store_true", help="skip the KV/indexer fake quantization")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests generating at once (batch rows)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context per request: prompt + completion (default: 4096, at most the model's "
                        "max_position_embeddings)")
    p.add_argument("--allow-beyond-max-position", action="store_true",
                   help="let --max-seq-len exceed the model's max_position_embeddings (positions it was not "
                        "trained for)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens prefilled per iteration (default: the scheduler's, 2048)")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    p.add_argument("--no-reuse", action="store_true",
                   help="do not reuse a finished row's caches for its next turn, nor keep prefix snapshots")
    p.add_argument("--snapshot-min-tokens", type=int, default=None, metavar="N",
                   help="keep a chat prompt's state at its system part's end and (thinking mode) before its final "
                        "<think> in a free row when that prefix is at least N tokens, for later prompts that share "
                        "it (0: never; default: the scheduler's, 256)")
    p.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="K drafts verified per decode step inside the scheduler (MTP, or DSpark if present; 0: off)")
    add_dspark_args(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decode step (default: on for CUDA)")
    p.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=False,
                   help="prefill chunks through compiled graphs per (rows, tokens) bucket, each compiled on first "
                        "use (default: off; docs/architecture.md, \"Compiled prefill\")")
    p.add_argument("--regional-compile", action="store_true",
                   help="compile one decoder layer at a time, decode steps and (with --compile-prefill) prefill "
                        "chunks: start-up compile time grows with the kinds of layers, not the depth")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every /v1 route")
    p.add_argument("--chat-format", choices=("auto", "deepseek_v4", "plain"), default="auto",
                   help="auto: DeepSeek-V4 when the tokenizer has its chat tokens, else chat is refused (400); "
                        "plain: messages' text joined by newlines (models without a chat format)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests may finish on SIGTERM")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
    p.add_argument("--debug", action="store_true", help="on a start-up error, show the traceback too")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="the server's and uvicorn's logging")
    return p


def _check(args) -> None:
    from dsv4_model.runtime.cli import check_model_arg

    check_model_arg(args.model)
    for name in ("max_batch_size", "max_seq_len", "max_waiting", "max_prefill_tokens", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    from dsv4_model.runtime.cli import check_threads_fit

    if args.threads is not None:
        check_threads_fit(args.threads)
    if not 0 <= args.port < 65536:
        raise ValueError("--port must be in [0, 65535]")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name: empty (leave it out for the checkpoint's name)")
    if args.drain_timeout < 0:
        raise ValueError("--drain-timeout must be >= 0")
    if args.snapshot_min_tokens is not None and args.snapshot_min_tokens < 0:
        raise ValueError(f"--snapshot-min-tokens must be >= 0, got {args.snapshot_min_tokens}")
    if args.speculate:
        from dsv4_model.model.checks import check_speculate

        check_speculate(args.speculate, "--speculate")
    from dsv4_model.runtime.cli import check_drafter_args, check_dspark_cut, check_regional_args

    check_dspark_cut(args.dspark_cut)
    check_drafter_args(args)
    check_regional_args(args)
    if args.dspark_cut and not args.speculate:
        raise ValueError("--dspark-cut: the confidence cut is DSpark's speculation's: it needs --speculate K")
    if args.act_quant == "nvfp4" and args.quant == "none":
        raise ValueError("--act-quant nvfp4 quantizes activations for NVFP4 weights (W4A4): it contradicts --quant none")


def check_checkpoint_options(args) -> None:
    """The options that depend on the checkpoint, from its config and tokenizer alone, before any weight is read
    (build_app's checks would come after the load): the tokenizer itself; --chat-format deepseek_v4 on a tokenizer
    without V4's chat tokens; --speculate K past a DSpark block, --dspark-cut without a DSpark module (as generate checks them)."""
    from dsv4_model.checkpoint.builtin import default_model_path
    from dsv4_model.checkpoint.hub import resolve_checkpoint
    from dsv4_model.checkpoint.loader import load_config
    from dsv4_model.checkpoint.tokenizer import load_tokenizer
    from dsv4_model.runtime.cli import _check_speculate_method
    from dsv4_model.serve.chat_format import ChatFormat

    path = resolve_checkpoint(args.model, "--model") if args.model is not None else default_model_path()[0]
    config = load_config(path)
    tok = load_tokenizer(path, config)  # a missing / unreadable / foreign tokenizer.json: refused here
    if args.chat_format == "deepseek_v4":
        ChatFormat(args.chat_format, tok)
    if args.speculate and not args.drafter:  # serve drafts with the checkpoint's DSpark where it has one
        _check_speculate_method(argparse.Namespace(**vars(args), speculate_method="auto"), config, path)


def default_max_seq_len(path, beyond: bool) -> int:
    """4096 positions per request, fewer where the model was trained for fewer."""
    from dsv4_model.checkpoint.hub import resolve_checkpoint
    from dsv4_model.checkpoint.loader import load_config

    config = load_config(resolve_checkpoint(path, "--model"))
    return DEFAULT_MAX_SEQ_LEN if beyond else min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)


def build_engine(args):
    """The engine (under torchrun: this rank's expert shard, after joining the group) and the checkpoint path."""
    import torch

    from dsv4_model.checkpoint.builtin import default_model_path
    from dsv4_model.model.checks import parse_device
    from dsv4_model.runtime import distributed
    from dsv4_model.runtime.cli import _drafters_to_load
    from dsv4_model.runtime.engine import Engine
    from dsv4_model.runtime.session import RunnerOptions

    device = parse_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shard = None
    if distributed.launched():  # expert parallelism: rank 0 serves HTTP and schedules, the others follow
        device, shard = distributed.init_expert_parallel(device)
    if args.model is not None:
        path = args.model
    else:
        path, what = default_model_path()
        print(f"note: {what}", file=sys.stderr)
    if args.max_seq_len is None:
        args.max_seq_len = default_max_seq_len(path, args.allow_beyond_max_position)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    quant = args.quant if args.quant != "auto" else (None if device.type == "cuda" else "none")
    if args.act_quant == "nvfp4" and args.quant == "auto":  # W4A4 needs NVFP4 weights: auto gets them (CPU or GPU)
        quant = "nvfp4"
    engine = Engine.from_pretrained(path, device=device, dtype=getattr(torch, args.dtype),
                                    act_quant=args.act_quant, simulate_quant=not args.no_simulate_quant,
                                    max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, quant=quant,
                                    runner_options=RunnerOptions(compile=True if args.regional_compile else
                                                                 args.compile, regional=args.regional_compile),
                                    compile_prefill=args.compile_prefill, progress=False, head_quant=args.head_quant,
                                    allow_beyond_max_position=args.allow_beyond_max_position,
                                    expert_shard=shard, **_drafters_to_load(args.speculate, args.drafter),
                                    **({"spare_window_slots": args.speculate} if args.speculate else {}))
    if args.speculate and args.draft_head != "stored":
        engine.set_draft_head(args.draft_head)
    return engine, path, shard


def _drafter(engine) -> str:
    """--speculate drafts with the checkpoint's DSpark module where it carries one, else with its MTP block."""
    return "dspark" if getattr(engine.model, "dspark", None) is not None else "mtp"


def build_app(args, engine, path, shard=None):
    from dsv4_model.runtime.cli import package_version
    from dsv4_model.runtime.scheduler import Scheduler
    from dsv4_model.serve.app import ServeConfig, create_app

    kw = {} if args.max_prefill_tokens is None else {"max_prefill_tokens": args.max_prefill_tokens}
    kw["reuse"] = not args.no_reuse
    if args.snapshot_min_tokens is not None:
        kw.update(snapshots=args.snapshot_min_tokens > 0, snapshot_min_tokens=max(args.snapshot_min_tokens, 1))
    if getattr(args, "speculate", 0):
        from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler

        method = _drafter(engine)
        if args.dspark_cut and method != "dspark":
            raise ValueError("--dspark-cut: the confidence cut is DSpark's, and this checkpoint has no DSpark module")
        scheduler = SpeculativeScheduler(engine, args.speculate, method=method, modes=SPECULATE_MODES,
                                         dspark_cut=args.dspark_cut, distributed=shard is not None, **kw)
    else:
        scheduler = Scheduler(engine, distributed=shard is not None, **kw)
    name = args.served_model_name or served_name(args.model, str(getattr(engine, "path", path)))
    cfg = ServeConfig(model_name=name, max_waiting=args.max_waiting, api_key=args.api_key,
                      drain_timeout_s=args.drain_timeout, chat_format=args.chat_format, version=package_version())
    return create_app(scheduler, cfg)


def served_name(model: str | None, path: str) -> str:
    """The model id clients name by default: a Hugging Face repo id as given (ORG/NAME, its @REV dropped; the
    loaded path is a snapshot hash), else the checkpoint directory's name, as vLLM and SGLang do."""
    if model and not os.path.isdir(model):
        return model.split("@", 1)[0]
    return os.path.basename(os.path.normpath(path))


def check_serving_packages() -> None:
    """The server's packages, before any weight is read: one clear error where the install left them out."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"serve needs {', '.join(missing)}: pip install 'dsv4[serve]' (from a source tree: "
                          "pip install --no-build-isolation '.[serve]')")


def check_port(host: str, port: int) -> None:
    """--host / --port free to listen on, checked before the model loads (minutes for a large one) rather than
    found by uvicorn after it; --port 0 takes any free port (the host is still checked: binding port 0 is)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None


def _announce(server, host: str) -> None:
    """One stderr line with the bound port once uvicorn listens (--port 0 picks it)."""
    while not server.started:
        if server.should_exit:
            return
        threading.Event().wait(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"dsv4 serve: listening on http://{host}:{port} (pid {os.getpid()})", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check(args)
        check_serving_packages()
        check_checkpoint_options(args)
        from dsv4_model.runtime.distributed import launch_rank

        if launch_rank() == 0:  # the rank that serves HTTP
            check_port(args.host, args.port)
        t0 = time.perf_counter()
        engine, path, shard = build_engine(args)
        if shard is not None and shard.rank:  # run rank 0's plans until its scheduler stops
            from dsv4_model.runtime.step_plan import follow

            for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains, then its stop plan ends this loop
                signal.signal(sig, signal.SIG_IGN)
            follow(engine, speculate=args.speculate, modes=SPECULATE_MODES if args.speculate else (),
                   method=_drafter(engine), dspark_cut=args.dspark_cut)
            return 0
        print(f"dsv4 serve: {getattr(engine, 'path', path)} loaded in {time.perf_counter() - t0:.1f} s on "
              f"{engine.device} (max batch {args.max_batch_size}, max seq len {args.max_seq_len})",
              file=sys.stderr, flush=True)
        app = build_app(args, engine, path, shard)
    except (ValueError, OSError, ImportError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while it loads / compiles: one line and 130, as generate's
        if args.debug:
            raise
        from dsv4_model.runtime.cli import _interrupted

        return _interrupted()
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout + 5.0)
    server = uvicorn.Server(config)
    threading.Thread(target=_announce, args=(server, args.host), daemon=True).start()
    # uvicorn handles SIGTERM / SIGINT while it runs (graceful shutdown, then the app's drain) and re-raises the
    # signal to the handler it found: a no-op one turns "killed by SIGTERM" into the exit 0 of a clean stop
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0
