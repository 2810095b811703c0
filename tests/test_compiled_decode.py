"""The compiled decode step (decode_step + dsv4::sample + on-device feedback, as DecodeRunner runs it):
one graph, no graph breaks, no recompiles over >= 1000 steps that cross every window / CSA / HCA boundary,
and logits that match eager at every step. GPU tests: CUDA-graph replay (manual and reduce-overhead) vs
eager, no host syncs in steady state, and identical generations across execution modes.

Tolerance (compiled vs eager logits): these tests run the model in fp32, where the compiled step matches
eager to ~1e-6 relative (measured on the micro model); we assert |compiled - eager| <= 1e-4 * (1 + |eager|)
per element (CPU; 1e-3 on the GPU, where cuBLAS and Triton kernels may pick other reduction orders). In bf16 the
two differ at bf16 resolution (Inductor keeps fp32 between fused ops where eager rounds every intermediate; up
to ~5% of 1 + |logit| after 3 layers even with `emulate_precision_casts`), which would only allow a test
too loose to catch real errors.
"""
import copy
import os

import pytest
import torch
from torch._dynamo.utils import counters

import dsv4_ops  # noqa: F401
from dsv4_model.checkpoint.writer import TINY_CONFIG
from dsv4_model.runtime.compiled import DecodeRunner
from dsv4_model.model.config import ModelConfig
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.generate import generate
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights
from dsv4_model.runtime.sampling import SamplingParams
from dsv4_model.runtime.session import RunnerOptions

STEPS = int(os.environ.get("DSV4_COMPILED_DECODE_STEPS", "1000"))
ATOL_REL = 1e-4
ATOL_REL_CUDA = 1e-3


def micro_config(**over) -> ModelConfig:
    # One SWA-only, one CSA (ratio 4, indexer top-4 of many entries) and one HCA (ratio 16) layer;
    # window 16, so 1000 steps wrap the ring ~60 times and close ~250 CSA / ~60 HCA windows.
    fields = {**TINY_CONFIG, "n_layers": 3, "compress_ratios": [0, 4, 16], "n_mtp_layers": 0,
              "n_hash_layers": 1, "n_routed_experts": 4}
    return ModelConfig(**{**fields, **over}).validate()


def make_model(device, max_batch_size=2, max_seq_len=None, seed=0, dtype=torch.float32):
    max_seq_len = max_seq_len or STEPS + 64
    return init_random_weights(Transformer(micro_config(), max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                           dtype=dtype, device=device), seed)


@pytest.fixture
def one_thread():
    # Decode is hundreds of tiny ops: intra-op threads only add latency (and stall on a busy CI box).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _close(got, want):
    tol = ATOL_REL if got.device.type == "cpu" else ATOL_REL_CUDA
    got, want = got.float(), want.float()
    err = torch.where(got == want, 0.0, (got - want).abs())  # equal infinities (score_state -inf) are equal
    return bool((err <= tol * (1 + want.abs().nan_to_num(posinf=0.0, neginf=0.0))).all()), float(err.max())


# The caches hold FP8 / FP4 fake-quantized values: a ~1e-6 difference before rounding can land on the adjacent
# code (one FP8 step is 2^-3 relative). Such a flip changes an isolated element; a wrong computation changes
# whole rows. So per step and buffer at most MAX_FLIPS elements may differ (beyond the tolerance); the compiled
# state is then reset to eager's, so flips never accumulate. Logits must match at every step, except in a row
# whose state flipped that step (FLIP_ROW_TOL below).
MAX_FLIPS = 2
FLIPS = [0]


def _mismatched(got, want):
    """Bool mask of the elements beyond the tolerance."""
    tol = ATOL_REL if got.device.type == "cpu" else ATOL_REL_CUDA
    got, want = got.float(), want.float()
    err = torch.where(got == want, 0.0, (got - want).abs())
    return err > tol * (1 + want.abs().nan_to_num(posinf=0.0, neginf=0.0))


# A flip in an entry the step itself wrote is read by the same step's attention: that row's logits may move by
# about one FP8 step of one key (measured: 2.6e-4 and 1.1e-3 on the CPU model), never the other rows'.
FLIP_ROW_TOL = 1e-2


def _cache_buffers(model):
    return {n: b for n, b in model.named_buffers() if n.endswith(("kv_cache", "kv_state", "score_state"))}


def _run_side_by_side(runner, eager_runner, prompts, steps):
    """Prefill both models, then step both runners (no recompiles allowed). After each step the logits AND
    every cache / compressor state the step wrote must match eager; then the compiled side is put back
    onto eager's tokens and state, so each step is checked from identical inputs (tiny per-step differences
    would otherwise compound over hundreds of steps and, via near-tied indexer top-k picks, diverge).
    Returns the largest logit difference."""
    B = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(B, int(lengths.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    params = [SamplingParams() for _ in range(B)]
    dev = eager_runner.device
    for r in (runner, eager_runner):
        r.prepare(B)
        logits = r.model.prefill(ids.to(dev), lengths.to(dev))
        r.begin(lengths.to(dev), params)
        r.sample_first(logits)
    FLIPS[0] = 0
    eager_state, comp_state = _cache_buffers(eager_runner.model), _cache_buffers(runner.model)
    assert eager_state.keys() == comp_state.keys() and eager_state
    worst = 0.0
    with torch.compiler.set_stance("fail_on_recompile"):
        for step in range(steps):
            le, ne = eager_runner.step()
            lc, nc = runner.step()
            flipped = torch.zeros(B, dtype=torch.bool, device=le.device)  # rows with a flip written this step
            for name, want in eager_state.items():
                bad = _mismatched(comp_state[name][:B], want[:B])
                n_bad = int(bad.sum())
                assert n_bad <= MAX_FLIPS, f"step {step}: {n_bad} elements of compiled {name} differ from eager"
                FLIPS[0] += n_bad
                flipped |= bad.flatten(1).any(1)
                comp_state[name].copy_(want)
            for row in range(B):
                ok, err = _close(lc[row], le[row])
                if bool(flipped[row]):
                    err_rel = float(((lc[row] - le[row]).abs() / (1 + le[row].abs())).max())
                    assert err_rel <= FLIP_ROW_TOL, f"step {step} row {row}: logits moved by {err_rel} after a flip"
                else:
                    worst = max(worst, err)
                    assert ok, f"step {step} row {row}: compiled logits differ from eager by {err}"
            runner.tokens[:B].copy_(ne)  # greedy near-ties may flip: keep both on the same sequence
    return worst


def test_compiled_decode_no_breaks_no_recompiles_matches_eager(one_thread):
    torch.manual_seed(0)
    eager_model = make_model("cpu")
    comp_model = copy.deepcopy(eager_model)
    counters.clear()
    runner = DecodeRunner(comp_model, compile=True)
    eager_runner = DecodeRunner(eager_model, compile=False)
    runner.prepare(2)  # compiles (the only compile)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1
    worst = _run_side_by_side(runner, eager_runner, [[0, 5, 6, 7, 8], [0, 9]], STEPS)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs
    # Positions advanced on device by exactly one per step (prompt lengths 5 and 2).
    assert runner.positions[:2].tolist() == [5 + STEPS, 2 + STEPS]
    print(f"max |compiled - eager| logits over {STEPS} steps: {worst:.3g}; quantization flips: {FLIPS[0]}")


def _regional_graphs(ratios, steps=40):
    """Regional compile of a micro model with layers of these ratios: (Dynamo graphs compiled, worst error vs
    eager over `steps` steps)."""
    cfg = micro_config(n_layers=len(ratios), compress_ratios=list(ratios))
    eager_model = init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=steps + 64), 0)
    comp_model = copy.deepcopy(eager_model)
    torch._dynamo.reset()  # the variants are cached across models too: count this model's alone
    counters.clear()
    runner = DecodeRunner(comp_model, compile=True, regional=True, compile_backend="aot_eager")
    assert runner.mode_name == "regional"
    runner.prepare(2)
    graphs = counters["stats"]["unique_graphs"]
    worst = _run_side_by_side(runner, DecodeRunner(eager_model, compile=False), [[0, 5, 6, 7, 8], [0, 9]], steps)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs, "regional compile recompiled after the first step"
    return graphs, worst


def test_regional_compile_reuses_layers_and_matches_eager(one_thread):
    # Layers that differ only in weights and caches share one compiled variant: a model three times as deep
    # (same kinds of layers) compiles no more graphs. Variants: the hash-routed first layer, the first user of
    # each shared per-step value, the CSA / HCA / SWA kinds, the last layer (no MoE fold into a next one).
    shallow, _ = _regional_graphs([0, 4, 16] + [4, 16, 0] * 2)
    deep, worst = _regional_graphs([0, 4, 16] + [4, 16, 0] * 6)
    assert deep == shallow, (shallow, deep)
    assert shallow <= 8
    print(f"regional: {shallow} graphs for 9 and 21 layers; max |regional - eager| logits {worst:.3g}")


# ------------------------------------------------------------------------------------------------ CUDA
PROMPTS = [[0, 5, 6, 7, 8, 9, 10, 11], [0, 12, 13], [0, 40, 41, 42, 43, 44], [0, 3]]


def _cuda_engine(dtype=torch.float32, **decode_options):
    model = make_model("cuda", max_batch_size=8, max_seq_len=512, dtype=dtype)
    return Engine(model, runner_options=RunnerOptions(**decode_options))


@pytest.mark.cuda
@pytest.mark.parametrize("graph_mode,pdl", [("manual", True), ("reduce-overhead", True), ("manual", False)])
def test_cuda_graph_logits_match_eager(graph_mode, pdl, override_kernels):
    # pdl (the default): the decode kernels launched with programmatic dependent launch, each waiting at its
    # top: a missing wait would read its predecessor's output early and break the match. Off: plain launches.
    override_kernels(pdl=pdl)
    eager_model = make_model("cuda", max_batch_size=8, max_seq_len=512)
    graph_model = copy.deepcopy(eager_model)
    counters.clear()
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        runner = DecodeRunner(graph_model, compile=True, cuda_graphs=True, graph_mode=graph_mode)
        eager_runner = DecodeRunner(eager_model, compile=False, cuda_graphs=False)
        _run_side_by_side(runner, eager_runner, PROMPTS[:3], 200)
    assert not counters["graph_break"]
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("graph_mode", ["manual", "reduce-overhead"])
def test_cuda_steady_state_has_no_host_sync(graph_mode):
    engine = _cuda_engine(compile=True, cuda_graphs=True, graph_mode=graph_mode)
    generate(engine, PROMPTS, max_new_tokens=4)  # compile + capture + first use
    runner = engine.runner()
    logits = engine.prefill(torch.tensor([[0, 5, 6, 7]] * 3))
    runner.begin(torch.tensor([4, 4, 4], device="cuda"), [SamplingParams(0.8, 20, 0.9, 1)] * 3)
    runner.sample_first(logits)
    pinned = torch.empty(3, dtype=torch.long, pin_memory=True)
    event = torch.cuda.Event()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            _, nxt = runner.step()
            pinned.copy_(nxt, non_blocking=True)
            event.record()
            event.synchronize()  # the loop's only wait: not a stream/device sync
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
def test_cuda_generation_identical_across_modes():
    # fp32 (see the module docstring): compiled-vs-eager differences are ~1e-6 relative, so greedy near-ties
    # (which bf16 rounding differences would flip) are vanishingly rare over these 160 tokens.
    modes = {
        "eager": dict(compile=False, cuda_graphs=False),
        "compiled": dict(compile=True, cuda_graphs=False),
        "graph": dict(compile=True, cuda_graphs=True, graph_mode="manual"),
        "reduce-overhead": dict(compile=True, cuda_graphs=True, graph_mode="reduce-overhead"),
    }
    greedy, sampled = {}, {}
    for name, opts in modes.items():
        engine = _cuda_engine(**opts)
        greedy[name] = generate(engine, PROMPTS, max_new_tokens=40).token_ids
        sampled[name] = generate(engine, PROMPTS, max_new_tokens=40, temperature=0.9, top_k=30, top_p=0.95,
                                 seed=7).token_ids
        torch._dynamo.reset()
    for name in modes:
        assert greedy[name] == greedy["eager"], name
        assert sampled[name] == sampled["eager"], name
    assert sampled["eager"] != greedy["eager"]


@pytest.mark.cuda
def test_cuda_step_past_the_caches_is_refused_and_the_context_survives():
    # Launched, such a step would write past the cache buffers (a device-side assert kills the CUDA context).
    engine = _cuda_engine(compile=False, cuda_graphs=True)
    want = generate(engine, PROMPTS[:1], max_new_tokens=4).token_ids
    runner = engine.runner()
    runner.begin([engine.max_seq_len - 1], [SamplingParams()])
    runner.step()
    with pytest.raises(ValueError, match="the caches hold max_seq_len"):
        runner.step()
    torch.cuda.synchronize()
    assert generate(engine, PROMPTS[:1], max_new_tokens=4).token_ids == want
