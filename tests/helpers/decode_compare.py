"""Teacher-forced decode on two execution paths: eager decode and a DecodeRunner path (compiled, CUDA graphs) fed
the same tokens, so their logits can be compared step by step.

Greedy ids alone cannot tell a broken path from a near-tie: the NVFP4 ops return bf16 even in an fp32 model, so
two correct paths can round an activation one bf16 ulp apart and flip a top-2 gap of ~1e-2. Used by
tests/test_default_model_gpu.py, tests/test_default_model.py, tests/test_indexer_cache.py and
scripts/compare_decode_paths.py (the command-line comparison of the paths, the multi-token decode of a
speculative step's verification among them).
"""
from __future__ import annotations

import torch

from dsv4_model.runtime.compiled import DecodeRunner
from dsv4_model.runtime.sampling import SamplingParams


def _prefill(engine, prompts: list[list[int]]) -> torch.Tensor:
    s = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (s - len(p)) for p in prompts])
    engine.reset()
    return engine.prefill(ids, torch.tensor([len(p) for p in prompts]))


@torch.no_grad()
def eager_decode(engine, prompts: list[list[int]], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy eager decode: (fed ids [steps, B] on the CPU, fp32 logits [steps, B, V] on the CPU).
    fed[s] is the token decode step s consumes (fed[0] = argmax of the prefill logits)."""
    nxt = _prefill(engine, prompts).float().argmax(-1)
    fed, logits = [], []
    for _ in range(steps):
        fed.append(nxt.cpu())
        out = engine.decode(nxt).float()
        logits.append(out.cpu())
        nxt = out.argmax(-1)
    return torch.stack(fed), torch.stack(logits)


@torch.no_grad()
def forced_decode(engine, prompts: list[list[int]], fed: torch.Tensor, runner: DecodeRunner | None = None,
                  **runner_options) -> torch.Tensor:
    """fp32 logits [steps, B, V] (CPU) of `runner` (default: a fresh DecodeRunner(**runner_options)) fed `fed`
    step by step."""
    if runner is None:
        torch._dynamo.reset()
        runner = DecodeRunner(engine.model, **runner_options)
    b = len(prompts)
    runner.prepare(b)  # compiles / captures; its warm-up writes cache rows, so it runs before the prefill
    _prefill(engine, prompts)
    runner.begin(engine.positions[:b].clone(), [SamplingParams() for _ in range(b)])
    out = []
    for step in range(fed.shape[0]):
        runner.tokens[:b].copy_(fed[step].to(runner.tokens.device))
        logits, _ = runner.step()
        out.append(logits.float().cpu())
    return torch.stack(out)


@torch.no_grad()
def multi_token_decode(engine, prompts: list[list[int]], fed: torch.Tensor, tokens: int = 2) -> torch.Tensor:
    """fp32 logits [steps, B, V] (CPU) of the multi-token decode (Transformer.decode_tokens: a speculative step's
    verification, eager) fed `fed` `tokens` at a time (steps: a multiple of tokens): what greedy speculation
    compares against the plain step's logits."""
    steps, b = fed.shape
    if steps % tokens:
        raise ValueError(f"steps ({steps}) must be a multiple of tokens ({tokens})")
    _prefill(engine, prompts)
    positions = engine.positions[:b].clone()
    out = []
    for s in range(0, steps, tokens):
        logits = engine.model.decode_tokens(fed[s:s + tokens].t().to(positions.device), positions)  # [B, T, V]
        out.extend(logits.float().cpu().unbind(1))
        positions = positions + tokens
    return torch.stack(out)


def fixed_prefix(ref: torch.Tensor, drift: float) -> list[int]:
    """Per row of eager's teacher-forced logits ref [steps, B, V]: how many greedy tokens a path whose logits
    stay within `drift` of eager's cannot flip (up to and including the first step whose top-2 gap is within
    2 * drift, the first that could go either way)."""
    top2 = ref.topk(2, dim=-1).values
    near = (top2[..., 0] - top2[..., 1]) <= 2 * drift  # [steps, B]
    out = []
    for row in range(ref.shape[1]):
        idx = near[:, row].nonzero()
        out.append(int(idx[0]) + 1 if len(idx) else ref.shape[0])
    return out


def decidable(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[steps, B] bool: (step, row) whose greedy token cannot flip within that row's observed drift."""
    top2 = ref.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]) > 2 * (got - ref).abs().amax(dim=-1) + 1e-6
