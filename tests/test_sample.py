"""dsv4::sample: exactness vs the pure-torch reference, distribution (chi-square), RNG stream properties,
opcheck, FakeTensor, torch.compile and CUDA-graph safety."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops.reference import philox4x32_10, sample_probs_ref, sample_ref

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


def _params(B, device, temperature=1.0, top_k=0, top_p=1.0, seed=1234, offset=0):
    def full(v, dtype):
        return torch.full((B,), v, dtype=dtype, device=device)

    return (full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
            full(seed, torch.int64), full(offset, torch.int64))


def _mixed_batch(B, V, device, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    logits = torch.randn(B, V, generator=g) * 3
    temperature = torch.rand(B, generator=g) * 1.5 + 0.05
    temperature[: B // 8] = 0.0  # greedy rows
    top_k = torch.randint(0, 60, (B,), generator=g)
    top_p = torch.rand(B, generator=g) * 0.6 + 0.3
    top_p[::3] = 1.0
    seed = torch.randint(0, 2**62, (B,), generator=g)
    offset = torch.randint(0, 2**40, (B,), generator=g)
    return [t.to(device) for t in (logits, temperature, top_k, top_p, seed, offset)]


def test_philox_reference_known_answers():
    # Random123 known-answer vectors for philox4x32-10 (counter, key) -> output.
    cases = [
        ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for ctr, key, want in cases:
        got = philox4x32_10(torch.tensor(ctr), torch.tensor(key))
        assert got.tolist() == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [1000, 1001])  # 1001: a partial last Philox group
def test_matches_reference(device, V):
    args = _mixed_batch(48, V, device)
    got = torch.ops.dsv4.sample(*args).cpu()
    want = sample_ref(*[a.cpu() for a in args])
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_first_argmax(device):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 777, generator=g)
    logits[3, 10] = logits[3, 500] = 100.0  # tie: the first index wins
    logits[4, :] = float("-inf")
    logits[4, 9] = -1e30
    logits[5, 7] = float("nan")  # NaN never wins
    logits = logits.to(device)
    out = torch.ops.dsv4.sample(logits, *_params(16, device, temperature=0.0, top_k=5, top_p=0.5))
    want = torch.argmax(torch.nan_to_num(logits.cpu(), nan=float("-inf")), dim=1)
    assert torch.equal(out.cpu(), want)
    assert out[3].item() == 10 and out[4].item() == 9


@pytest.mark.parametrize("device", DEVICES)
def test_seed_and_offset_streams(device):
    B, V = 64, 4096
    logits = torch.zeros(B, V, device=device)  # uniform: every draw is pure RNG
    t, k, p, s, _ = _params(B, device)
    offsets = torch.arange(B, device=device)
    a = torch.ops.dsv4.sample(logits, t, k, p, s, offsets)
    b = torch.ops.dsv4.sample(logits, t, k, p, s, offsets.clone())
    assert torch.equal(a, b)  # same (seed, offset) => same tokens
    assert a.unique().numel() > 56  # 64 offsets => (almost surely) distinct draws
    same = torch.ops.dsv4.sample(logits, t, k, p, s, torch.zeros_like(offsets))
    assert same.unique().numel() == 1  # the row index does not enter the stream
    other_seed = torch.ops.dsv4.sample(logits, t, k, p, s + 1, offsets)
    assert (other_seed != a).sum() > 56


LOGITS8 = [2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0]
MODES = {  # name: (temperature, top_k, top_p)
    "temperature": (0.7, 0, 1.0),
    "top_k": (1.0, 3, 1.0),
    "top_p": (1.0, 0, 0.6),
    "top_k_top_p": (1.3, 5, 0.75),
}


def _chi2_pvalue(counts, probs):
    n = counts.sum()
    keep = probs > 0
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum()
    df = keep.sum() - 1
    return torch.special.gammaincc(df / 2.0, stat / 2.0).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_distribution_chi_square(device, mode):
    T, k, p = MODES[mode]
    N = 20000
    row = torch.tensor([LOGITS8])
    probs = sample_probs_ref(row, torch.tensor([T]), torch.tensor([k]), torch.tensor([p]))[0]
    if p < 1.0:  # the top-p cut must not sit on a near-tie, where fixed-point rounding could decide it
        in_k = torch.arange(8) < (k if k > 0 else 8)  # LOGITS8 is sorted descending
        base = torch.softmax(torch.where(in_k, row[0].double() / T, float("-inf")), 0)
        assert ((base.cumsum(0) - p).abs() > 1e-4).all()
    logits = row.expand(N, -1).contiguous().to(device)
    t, kk, pp, s, _ = _params(N, device, temperature=T, top_k=k, top_p=p, seed=77)
    out = torch.ops.dsv4.sample(logits, t, kk, pp, s, torch.arange(N, device=device)).cpu()
    counts = torch.bincount(out, minlength=8).double()
    assert (counts[probs == 0] == 0).all(), counts
    assert _chi2_pvalue(counts, probs) > 1e-3
    # Power check: the same counts must reject a wrong hypothesis (plain softmax at T=1 / without filters).
    wrong = torch.softmax(row[0].double() / (1.0 if mode != "temperature" else 1.4), 0)
    assert _chi2_pvalue(counts, wrong) < 1e-6


def _opcheck_samples(device):
    out = [_mixed_batch(8, 257, device)]
    one = _mixed_batch(1, 64, device, gen_seed=3)
    one[1].fill_(0.9)
    out.append(one)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args in _opcheck_samples(device):
        torch.library.opcheck(torch.ops.dsv4.sample.default, tuple(args))


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = [torch.empty(5, 33), *_params(5, "cpu")]
        out = torch.ops.dsv4.sample(*args)
    assert out.shape == (5,) and out.dtype == torch.int64
    meta = torch.ops.dsv4.sample(torch.empty(3, 9, device="meta"), *_params(3, "meta"))
    assert meta.shape == (3,) and meta.dtype == torch.int64


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_fullgraph_with_device_offset(device):
    """Sampling + on-device offset bump compile into one graph and reproduce the eager stream."""
    from torch._dynamo.utils import counters

    B, V = 4, 300

    def step(logits, t, k, p, s, o):
        tok = torch.ops.dsv4.sample(logits * 1.0, t, k, p, s, o)
        o.add_(1)
        return tok

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(B, V, generator=g) * 2).to(device)
    t, k, p, s, o_eager = _params(B, device, temperature=0.8, top_k=20, top_p=0.9)
    o_comp = o_eager.clone()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    eager_toks = [step(logits, t, k, p, s, o_eager) for _ in range(4)]
    comp_toks = [compiled(logits, t, k, p, s, o_comp) for _ in range(4)]
    assert not counters["graph_break"]
    assert torch.equal(o_comp, o_eager)
    for a, b in zip(eager_toks, comp_toks):
        assert torch.equal(a, b)
    assert len({tuple(x.tolist()) for x in eager_toks}) > 1  # offsets advanced => new draws


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_matches_cpu_full_vocab():
    """V = 129280 with heavy ties (bf16-rounded logits) exercises every radix level of the CUDA search."""
    B, V = 12, 129280
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(B, V, generator=g) * 4).to(torch.bfloat16).float()
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 0.9, 1e-3, 1.0])
    top_k = torch.tensor([0, 0, 50, 1, 0, 1000, 0, 129279, 7, 40, 0, 200000])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.9, 0.95, 0.5, 1.0, 0.0, 0.8, 0.9, 0.3])
    seed = torch.randint(0, 2**62, (B,), generator=g)
    offset = torch.randint(0, 2**40, (B,), generator=g)
    args = (logits, temperature, top_k, top_p, seed, offset)
    want = torch.ops.dsv4.sample(*args)
    got = torch.ops.dsv4.sample(*[a.cuda() for a in args]).cpu()
    assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_advances_stream():
    B, V = 8, 5000
    logits = torch.randn(B, V, device="cuda") * 2
    t, k, p, s, offset = _params(B, "cuda", temperature=1.0, top_k=100, top_p=0.9)
    ref_offset = offset.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        torch.ops.dsv4.sample(logits, t, k, p, s, offset)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tok = torch.ops.dsv4.sample(logits, t, k, p, s, offset)
        offset.add_(1)
    offset.copy_(ref_offset)
    torch.cuda.set_sync_debug_mode("error")
    try:
        draws = []
        for _ in range(3):
            graph.replay()
            draws.append(tok.clone())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for i, d in enumerate(draws):
        want = torch.ops.dsv4.sample(logits, t, k, p, s, ref_offset + i)
        assert torch.equal(d, want)
    assert not torch.equal(draws[0], draws[1])
