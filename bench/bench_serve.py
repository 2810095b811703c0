"""Load generator for OpenAI-compatible servers (ours or any other), in the manner of `vllm bench serve`.

    python bench/bench_serve.py --url http://127.0.0.1:8000 --concurrency 8 --num-requests 64 --max-tokens 64
    python bench/bench_serve.py --url ... --request-rate 4        # Poisson arrivals, 4 requests/s on average
    python bench/bench_serve.py --stub-server --port 8011         # a server on a stub scheduler (front-end cost)
    python bench/bench_serve.py --preset-server flash2 --port 8012   # our server on a random NVFP4 preset model

Streams /v1/completions (or /v1/chat/completions with --chat) with ignore_eos, measures per request TTFT, TPOT
(mean time per output token after the first), ITL (gaps between chunks) and end-to-end latency, and prints one
JSON object: percentiles, request / output-token throughput. Prompts: random words (--prompt-words) or lines of
--prompt-file."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import percentile, preset_engine  # noqa: E402


def _summary(xs: list[float]) -> dict:
    return {"mean_ms": 1e3 * statistics.fmean(xs) if xs else float("nan"),
            **{f"p{q}_ms": 1e3 * percentile(xs, q) for q in (50, 90, 99)}}


async def _one(client, url: str, args, prompt: str) -> dict:
    body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    if args.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    t0 = time.perf_counter()
    times, chunks = [], 0
    async with client.stream("POST", url + path, json=body, headers=args.headers) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            ch = d.get("choices") or []
            if ch and ((ch[0].get("text") or (ch[0].get("delta") or {}).get("content")
                        or (ch[0].get("delta") or {}).get("reasoning_content"))):
                times.append(time.perf_counter())
                chunks += 1
    end = time.perf_counter()
    return {"ok": True, "start": t0, "times": times, "end": end, "tokens": args.max_tokens}


async def run(args) -> dict:
    import httpx

    rng = random.Random(args.seed)
    if args.prompt_file:
        lines = [ln for ln in Path(args.prompt_file).read_text().splitlines() if ln.strip()]
        prompts = [lines[i % len(lines)] for i in range(args.num_requests)]
    else:
        words = ["def", "class", "return", "import", "value", "data", "self", "list", "for", "if", "x", "y"]
        prompts = [" ".join(rng.choice(words) for _ in range(args.prompt_words)) for _ in range(args.num_requests)]
    limits = httpx.Limits(max_connections=max(args.concurrency, 1) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        sem = asyncio.Semaphore(args.concurrency)

        async def guarded(p):
            async with sem:
                return await _one(client, args.url, args, p)

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
            tasks.append(asyncio.create_task(guarded(p)))
        res = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in res if r["ok"]]
    ttft = [r["times"][0] - r["start"] for r in ok if r["times"]]
    tpot = [(r["end"] - r["times"][0]) / (r["tokens"] - 1) for r in ok if r["times"] and r["tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    e2e = [r["end"] - r["start"] for r in ok]
    out_tokens = sum(r["tokens"] for r in ok)
    return {"url": args.url, "concurrency": args.concurrency, "request_rate": args.request_rate,
            "num_requests": len(res), "failed": len(res) - len(ok), "max_tokens": args.max_tokens,
            "wall_s": wall, "request_throughput": len(ok) / wall, "output_token_throughput": out_tokens / wall,
            "ttft": _summary(ttft), "tpot": _summary(tpot), "itl": _summary(itl), "e2e": _summary(e2e)}


def stub_server(args) -> None:
    """Our app on a StubScheduler: tokens come at once, so the client sees the front end's cost alone."""
    from dsv4_model.checkpoint.builtin import default_model_path
    from dsv4_model.checkpoint.tokenizer import load_tokenizer
    from dsv4_model.checkpoint.loader import load_config
    from dsv4_model.serve.app import ServeConfig, create_app
    from dsv4_model.serve.stub import StubScheduler

    path = default_model_path()[0]
    tok = load_tokenizer(path, load_config(path))
    text = tok.encode("    return self.value + other.value  # a line of code\n", add_bos=False)
    app = create_app(StubScheduler(tok, lambda req: text, max_rows=256),
                     ServeConfig(model_name=args.model, max_waiting=4096, chat_format="plain"))
    _run(app, args.port)


class WordTokenizer:
    """A stand-in tokenizer for a random model: id i is the word " t<i>", so every generated token shows as text
    (a real tokenizer smaller than the model's vocabulary would decode most random ids to nothing); words of a
    prompt map to ids by CRC."""

    kind = "words"

    def __init__(self, vocab_size: int, bos_id: int, eos_id: int):
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, bos_id, eos_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        import zlib

        ids = [zlib.crc32(w.encode()) % self.vocab_size for w in text.split()]
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return "".join(f" t{i}" for i in ids)


def preset_server(args) -> None:
    """Our app and scheduler on a random NVFP4 model of a bench/common.py preset (flash2, flash43, ...), built on
    the GPU: the served figures of models too large for a checkpoint on disk."""
    import torch

    from dsv4_model.runtime.scheduler import Scheduler
    from dsv4_model.serve.app import ServeConfig, create_app

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    say(f"building {args.preset_server} on {device}; then every batch bucket up to {args.max_batch_size} is "
        "compiled + captured before the server listens")
    engine = preset_engine(args.preset_server, experts=args.experts, rows=args.max_batch_size,
                           max_seq_len=args.max_seq_len, device=device, regional=args.regional_compile, log=say)
    engine.compile_prefill = args.compile_prefill
    cfg = engine.config
    tok = WordTokenizer(cfg.vocab_size, int(cfg.bos_token_id), int(cfg.eos_token_id))
    app = create_app(Scheduler(engine, tokenizer=tok),
                     ServeConfig(model_name=args.model, max_waiting=4096, chat_format="plain"))
    print(f"serving {args.preset_server} ({cfg.n_layers} layers, {cfg.n_routed_experts} experts) on {device}",
          file=sys.stderr, flush=True)
    _run(app, args.port)


def _run(app, port: int) -> None:
    """uvicorn on loopback; SIGTERM / SIGINT: its graceful shutdown, then exit 0 (uvicorn re-raises the signal it
    caught to the handler it found: a no-op one, as `python -m dsv4_model serve` installs)."""
    import signal

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="default")
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--stub-server", action="store_true", help="serve our app on a stub scheduler instead")
    p.add_argument("--port", type=int, default=8011, help="--stub-server's / --preset-server's port")
    p.add_argument("--preset-server", metavar="NAME", default=None,
                   help="serve our app on a random NVFP4 model of this bench/common.py preset instead")
    p.add_argument("--experts", type=int, default=None, help="--preset-server: routed experts (default: all)")
    p.add_argument("--max-batch-size", type=int, default=64, help="--preset-server: batch rows")
    p.add_argument("--max-seq-len", type=int, default=1024, help="--preset-server: context per row")
    p.add_argument("--regional-compile", action="store_true",
                   help="--preset-server: compile one decoder layer at a time (serve --regional-compile)")
    p.add_argument("--compile-prefill", action="store_true",
                   help="--preset-server: prefill chunks through compiled graphs (serve --compile-prefill)")
    args = p.parse_args(argv)
    if args.stub_server:
        stub_server(args)
        return 0
    if args.preset_server:
        preset_server(args)
        return 0
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    res = asyncio.run(run(args))
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
