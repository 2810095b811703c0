"""Compiled prefill chunks (dsv4_model.runtime.compiled_prefill, Engine(compile_prefill=)): the scheduler's chunks
through one graph per (rows, tokens) bucket give eager prefill_at's logits and caches, padded rows leave the cache
rows they stand on exactly as they were, and the scheduler's greedy tokens are eager's.

CPU tests compile with the aot_eager backend (Dynamo + AOT autograd's traced graph, no Inductor: a cold Inductor
compile of the prefill takes minutes on this CPU; the decode tests cover Inductor's CPU codegen). Tolerances: the
static-shape MoE (float experts' gather + einsum, what the compiled chunk runs) sums in another order than eager's
per-expert loop: equal in bf16 on the built-in model, ~1e-6 apart in fp32 (TOL). The CUDA test runs Inductor."""
import copy

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_model.checkpoint.builtin import DEFAULT_MODEL_DIR
from dsv4_model.checkpoint.writer import make_config
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights
from dsv4_model.runtime.compiled_prefill import CompiledPrefill, token_buckets
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.sampling import SamplingParams
from dsv4_model.runtime.scheduler import Scheduler

TOL = dict(atol=2e-5, rtol=2e-5)


def _tiny(rows: int = 4) -> Transformer:
    return init_random_weights(Transformer(make_config("tiny"), max_batch_size=rows, max_seq_len=128,
                                           dtype=torch.float32, simulate_quant=False), 0).eval()


def _buffers(m: Transformer) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in m.named_buffers()}


def test_buckets():
    assert token_buckets(128) == [16, 32, 64, 128]
    assert token_buckets(100) == [16, 32, 64, 100]
    cp = CompiledPrefill(_tiny(), backend="aot_eager")
    assert cp.row_buckets == [1, 2, 4]
    assert cp.bucket(3, 17) == (4, 32) and cp.bucket(1, 1) == (1, 16)
    with pytest.raises(ValueError, match="max_batch_size=4 x max_seq_len=128"):
        cp.bucket(5, 8)
    # float experts: a bucket whose gathered expert weights pass the bound runs eagerly
    assert CompiledPrefill(_tiny(), backend="aot_eager", moe_gather_bytes=1).bucket(1, 1) is None


def test_padded_rows_untouched_and_logits_equal_eager():
    """Rows 0..2 hold sequences; a chunk of rows [:3] (row 1 idle, length 0 at its own position) pads to a
    bucket of 4 rows x 32 tokens: row 3's caches stay bit for bit, rows [:3] match eager's; prepare() writes
    nothing; a second chunk of the same buckets at other starts does not recompile."""
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (4, 60), generator=torch.Generator().manual_seed(0))
    eager, comp = _tiny(), _tiny()
    for m in (eager, comp):
        m.prefill(ids[:, :20], torch.tensor([20, 13, 7, 18]))
    cp = CompiledPrefill(comp, backend="aot_eager")
    before = _buffers(comp)
    cp.prepare(3, 20)
    assert cp.compiled == 1
    assert all(torch.equal(b, before[n]) for n, b in comp.named_buffers()), "prepare() wrote a buffer"
    tokens = torch.stack([ids[0, 20:40], ids[1, 13:33], ids[2, 7:27]])
    lengths, start = torch.tensor([20, 0, 11]), torch.tensor([20, 13, 7])
    ref = eager.prefill(tokens, lengths, start=start)
    got = cp(tokens, lengths, start)
    assert got.shape == ref.shape
    torch.testing.assert_close(got[lengths > 0], ref[lengths > 0], **TOL)
    for n, b in comp.named_buffers():
        assert torch.equal(b[3:], before[n][3:]), f"{n}: the padded row's cache row changed"
    with torch.compiler.set_stance("fail_on_recompile"):
        nxt = torch.stack([ids[0, 40:60], ids[1, 13:33], ids[2, 18:38]])
        lengths, start = torch.tensor([20, 17, 20]), torch.tensor([40, 13, 18])
        torch.testing.assert_close(cp(nxt, lengths, start), eager.prefill(nxt, lengths, start=start), **TOL)
    # what decode reads next is eager's (past a row's length the padded chunk leaves other junk entries than
    # eager's shorter one: positions the row's next chunk or step rewrites before reading them)
    pos = torch.tensor([60, 30, 38, 18])
    for k in range(3):
        step = ids[:, 50 + k]
        torch.testing.assert_close(comp.decode_step(step, pos + k), eager.decode_step(step, pos + k), **TOL)
    assert cp.compiled == 1


def _regional_run(ratios: list[int]) -> tuple[int, float]:
    """A float32 model with layers of these compress ratios: two chunks (rows at their own starts) through
    regional compiled prefill against eager. Returns (Dynamo graphs compiled, worst |logits - eager|)."""
    from torch._dynamo.utils import counters

    cfg = make_config("tiny", n_layers=len(ratios), compress_ratios=list(ratios), n_mtp_layers=0, n_hash_layers=1,
                      n_routed_experts=4)
    eager = init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=96, dtype=torch.float32,
                                            simulate_quant=False), 0).eval()
    comp = copy.deepcopy(eager)
    torch._dynamo.reset()  # variants are cached across models: count this model's alone
    counters.clear()
    cp = CompiledPrefill(comp, backend="aot_eager", regional=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 60), generator=torch.Generator().manual_seed(1))
    worst = 0.0
    for start, lengths in ((torch.tensor([0, 0]), torch.tensor([30, 21])), (torch.tensor([30, 21]),
                                                                             torch.tensor([30, 25]))):
        tokens = torch.stack([ids[b, int(s):int(s) + 30] for b, s in enumerate(start)])
        ref = eager.prefill(tokens, lengths, start=start)
        got = cp(tokens, lengths, start)
        torch.testing.assert_close(got, ref, **TOL)
        worst = max(worst, float((got - ref).abs().max()))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert cp.compiled == 1  # one (rows, tokens) bucket: 2 x 32
    pos = torch.tensor([60, 46])
    torch.testing.assert_close(comp.decode_step(ids[:, 59], pos), eager.decode_step(ids[:, 59], pos), **TOL)
    return counters["stats"]["unique_graphs"], worst


def test_regional_reuses_layers_and_matches_eager():
    """regional=True compiles each decoder layer's prefill as a region: a model three times as deep (the same
    kinds of layers) compiles no more graphs, and its logits (and the caches decode reads next) are eager's.
    Variants: the hash-routed first layer, then one per layer kind (SWA / CSA / HCA)."""
    shallow, _ = _regional_run([0, 4, 16] + [4, 16, 0] * 2)
    deep, worst = _regional_run([0, 4, 16] + [4, 16, 0] * 6)
    assert deep == shallow, (shallow, deep)
    assert 3 <= shallow <= 6, shallow  # (a whole-chunk graph would be one)
    print(f"regional prefill: {shallow} graphs for 9 and 21 layers; max |regional - eager| logits {worst:.3g}")


def test_engine_option_defaults_and_types():
    eng = Engine(_tiny())
    assert eng.compiled_prefill() is None  # CPU: off unless asked
    eng.compile_prefill = True
    assert isinstance(eng.compiled_prefill(), CompiledPrefill)
    with pytest.raises(TypeError, match="compile_prefill must be a bool"):
        Engine(_tiny(), compile_prefill="yes")


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    sched = Scheduler(engine, max_prefill_tokens=16)
    reqs = [sched.submit(Request(p, SamplingParams(), max_tokens=12, ignore_eos=True)) for p in prompts]
    sched.run_until_idle()
    return [r.token_ids for r in reqs]


def test_scheduler_greedy_tokens_equal_eager():
    """The built-in model (bf16) under the scheduler: prompts of 5..40 tokens in chunks of 16, two rows, three
    requests (the third joins as a row frees): compiled chunks (aot_eager) give eager's greedy tokens."""
    torch._dynamo.reset()
    torch.set_num_threads(1)
    eng = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.bfloat16, max_batch_size=2,
                                 max_seq_len=128, quant="none", progress=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, eng.vocab_size, (n,), generator=g).tolist() for n in (40, 5, 23)]
    ref = _greedy(eng, prompts)
    eng.compile_prefill = True
    eng._compiled_prefill = CompiledPrefill(eng.model, backend="aot_eager")  # the CPU tests' backend
    assert _greedy(eng, prompts) == ref
    assert eng._compiled_prefill.compiled >= 1


@pytest.mark.cuda
def test_scheduler_greedy_tokens_equal_eager_on_cuda():
    """On the GPU with Inductor (CompiledPrefill's default backend), the built-in model in fp32 with float experts (Inductor's
    fusions move fp32 logits ~1e-6: no near-tie flips; bf16 moves them ~0.06), greedy tokens equal."""
    eng = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cuda", dtype=torch.float32, max_batch_size=4,
                                 max_seq_len=256, quant="none", progress=False, compile_prefill=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, eng.vocab_size, (n,), generator=g).tolist() for n in (70, 5, 23, 33, 50)]
    ref = _greedy(eng, prompts)
    eng.compile_prefill = True
    assert eng.compiled_prefill() is not None
    assert _greedy(eng, prompts) == ref


@pytest.mark.parametrize("flag,want", [([], False), (["--compile-prefill"], True), (["--no-compile-prefill"], False)])
def test_cli_flags_reach_the_engine(monkeypatch, flag, want):
    from dsv4_model.runtime import cli
    from dsv4_model.serve import cli as serve_cli

    seen = []

    class Stop(Exception):
        pass

    def fake(*a, compile_prefill, **k):
        seen.append(compile_prefill)
        raise Stop

    monkeypatch.setattr("dsv4_model.runtime.engine.Engine.from_pretrained", staticmethod(fake))
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # this process's threads are pytest's
    with pytest.raises(Stop):
        cli.cmd_generate(cli._parser().parse_args(["generate", "--prompt", "x", "--device", "cpu", *flag]))
    with pytest.raises(Stop):
        serve_cli.build_engine(serve_cli._parser().parse_args(["--device", "cpu", *flag]))
    assert seen == [want, want]


def test_serve_regional_compile_reaches_the_engine(monkeypatch):
    """`serve --regional-compile`: the engine's runner options compile layer by layer (decode and, with
    --compile-prefill, the prefill chunks); with --no-compile or --speculate it is refused in one line."""
    from dsv4_model.serve import cli as serve_cli

    seen = []

    class Stop(Exception):
        pass

    def fake(*a, runner_options, compile_prefill, **k):
        seen.append((runner_options.compile, runner_options.regional, compile_prefill))
        raise Stop

    monkeypatch.setattr("dsv4_model.runtime.engine.Engine.from_pretrained", staticmethod(fake))
    for flags, want in (([], (None, False, False)), (["--regional-compile", "--compile-prefill"], (True, True, True))):
        with pytest.raises(Stop):
            serve_cli.build_engine(serve_cli._parser().parse_args(["--device", "cpu", *flags]))
        assert seen.pop() == want
    for flags, msg in ((["--no-compile"], "it contradicts --no-compile"),
                       (["--speculate", "1"], "speculative steps compile whole")):
        with pytest.raises(ValueError, match=msg):
            serve_cli._check(serve_cli._parser().parse_args(["--regional-compile", *flags]))
