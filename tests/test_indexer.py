"""dsv4::indexer_score_topk (DeepSeek-V4 lightning indexer at decode) and the FP4 key storage helpers.

Numerics against dsv4_ops.reference: exactly (set, order and ties) on inputs whose scores are exact in fp32,
and tolerance-aware on random inputs (kernels may sum in another order); plus opcheck, FakeTensor,
torch.compile(fullgraph=True) and CUDA-graph replay without host syncs.
"""
import math

import pytest
import torch

import dsv4_ops  # noqa: F401  (loads the library and the fakes)
from dsv4_ops import reference as ref

OP = torch.ops.dsv4.indexer_score_topk
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


# ---------------------------------------------------------------------------------------------------------
# input builders
# ---------------------------------------------------------------------------------------------------------


def random_inputs(B, N, H, D, *, q_dtype=torch.bfloat16, seed=0, device="cpu"):
    """Gaussian queries / keys (keys with per-key magnitudes over ~3 octaves), keys stored with the quantizer."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, N, D, generator=g) * torch.exp(torch.randn(B, N, 1, generator=g))
    codes, scales = ref.indexer_fp4_quantize_keys(k)
    q = torch.randn(B, H, D, generator=g).to(q_dtype)
    w = torch.randn(B, H, generator=g) * H**-0.5
    return [t.to(device) for t in (q, w, codes, scales)]


def exact_inputs(B, N, H, D, *, q_dtype=torch.bfloat16, seed=0, device="cpu", zero_frac=0.25, dup_frac=0.25):
    """Small-integer q, dyadic weights, random FP4 codes with scales 2^-1..2^1: every product and partial sum
    is exact in fp32 (|score| < 2^21 on a 2^-3 grid), so any summation order gives the same score. A fraction
    of the keys are all-zero (score exactly 0) and another fraction duplicate other keys (exact ties)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (B, H, D), generator=g).to(q_dtype)
    w = torch.tensor([-1.0, 0.5, 1.0, 2.0])[torch.randint(0, 4, (B, H), generator=g)]
    codes = torch.randint(0, 256, (B, N, D // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(126, 129, (B, N, D // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    if N > 1:
        zero = torch.rand(B, N, generator=g) < zero_frac
        codes[zero] = 0
        dup = torch.rand(B, N, generator=g) < dup_frac
        src = torch.randint(0, N, (B, N), generator=g)
        for b in range(B):
            d = dup[b].nonzero().flatten()
            codes[b, d] = codes[b, src[b, d]]
            scales[b, d] = scales[b, src[b, d]]
    return [t.to(device) for t in (q, w, codes, scales)]


def nvalid_rows(N, topk):
    """One row per interesting n_valid (0, 1, topk-1, topk, topk+1, N) plus out-of-range values that clamp; 37,
    128, 129: every key selected, ordered by the CUDA kernel's rank count (<= 128 keys) or its sort."""
    vals = [0, 1, 37, 128, 129, topk - 1, topk, topk + 1, N, N + 7, -3]
    return [min(max(v, -3), N + 7) for v in vals]


# ---------------------------------------------------------------------------------------------------------
# comparison helpers
# ---------------------------------------------------------------------------------------------------------


def assert_topk_close(out, scores, n_valid, topk, rtol):
    """Tolerance-aware check of a top-k result against reference scores [B, N].

    The j-th returned index must carry (within tol) the j-th best reference score among i < n_valid, which
    checks the set and the order; members may differ from the reference set only where the reference score is
    within tol of the k-th score. tol = rtol * max |score| of the row.
    """
    out = out.cpu()
    scores = scores.cpu().double()
    B, N = scores.shape
    assert out.shape == (B, topk) and out.dtype == torch.int32
    for b in range(B):
        nv = min(max(int(n_valid[b]), 0), N)
        take = min(topk, nv)
        row = out[b].tolist()
        assert row[take:] == [-1] * (topk - take), f"row {b}: padding"
        sel = row[:take]
        assert all(0 <= i < nv for i in sel) and len(set(sel)) == take, f"row {b}: invalid or repeated indices"
        if take == 0:
            continue
        s = scores[b, :nv]
        best = torch.sort(s, descending=True).values
        tol = rtol * s.abs().max().item()
        got = s[torch.tensor(sel)]
        assert (got - best[:take]).abs().max().item() <= tol, f"row {b}: scores off by more than {tol}"
        kth = best[take - 1].item()
        want = set(torch.sort(s, descending=True, stable=True).indices[:take].tolist())
        for i in set(sel) - want:
            assert s[i].item() >= kth - tol, f"row {b}: {i} is not near the k-th score"
        for i in want - set(sel):
            assert s[i].item() <= kth + tol, f"row {b}: missed {i} clearly above the k-th score"


# ---------------------------------------------------------------------------------------------------------
# FP4 key storage
# ---------------------------------------------------------------------------------------------------------


def _brute_quantize_block(x):
    """Independent model of the storage of one 32-block (python floats, exact rational comparisons)."""
    amax = max(abs(v) for v in x)
    amax = max(amax, 6 * 2.0**-126)
    e = math.floor(math.log2(amax)) - 4
    while 6 * 2.0**e < amax:  # smallest power of two >= amax / 6, compared exactly as 6 * 2^e >= amax
        e += 1
    codes = []
    for v in x:
        y = v / 2.0**e
        dist = [abs(abs(y) - m) for m in E2M1]
        best = min(range(8), key=lambda c: (dist[c], c % 2))  # nearest, ties to the even code
        codes.append(best | (8 if (y < 0 and best > 0) else 0))
    return codes, e + 127


def _unpack(codes):
    c = codes.to(torch.int32)
    return torch.stack((c & 0xF, c >> 4), dim=-1).flatten(-2)


def test_quantizer_matches_bruteforce():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randn(48, 32, generator=g) * torch.exp2(torch.randint(-20, 20, (48, 1), generator=g).float())
    # Values on every rounding midpoint (x/scale = 0.25, 0.75, ..., 5) and every grid point, with amax = 6.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.1])
    blocks[0] = torch.cat([mids, -mids])
    blocks[1] = blocks[0] * 2.0**-7
    blocks[2] = 0.0  # amax == 0
    blocks[3] = torch.linspace(-7.0, 7.0, 32)  # amax just above 6 -> scale 2
    blocks[4, :] = 1e-38  # tiny amax: the 6 * 2^-126 floor
    blocks = blocks.to(torch.bfloat16).float()  # the model stores bf16 keys
    codes, scales = ref.indexer_fp4_quantize_keys(blocks)
    assert codes.shape == (48, 16) and codes.dtype == torch.uint8
    assert scales.shape == (48, 1) and scales.dtype == torch.uint8
    nib = _unpack(codes)
    for r in range(blocks.shape[0]):
        want_codes, want_e = _brute_quantize_block(blocks[r].tolist())
        assert scales[r, 0].item() == want_e, f"block {r}"
        assert nib[r].tolist() == want_codes, f"block {r}"


def test_quantizer_scale_rule_hand_blocks():
    def q1(amax_entries):
        x = torch.zeros(32)
        x[: len(amax_entries)] = torch.tensor(amax_entries)
        c, s = ref.indexer_fp4_quantize_keys(x)
        return _unpack(c)[: len(amax_entries)].tolist(), s.item()

    assert q1([6.0]) == ([7], 127)  # amax/6 = 1 -> scale 1
    assert q1([7.0]) == ([6], 128)  # 7/6 -> 2: 7/2 = 3.5 ties to 4 (code 6)
    assert q1([12.0, -12.0]) == ([7, 15], 128)
    assert q1([3.0, 0.75, -0.375]) == ([7, 3, 8 | 2], 126)  # scale 1/2: 1.5 -> code 3, -0.75 -> -1.0
    assert q1([1.0]) == ([6], 125)  # 1/6 rounds up to 1/4: 1 / 0.25 = 4.0 is code 6
    assert q1([0.0]) == ([0], 1)  # amax 0 -> floor 6*2^-126 -> scale 2^-126
    assert q1([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.2]) == ([7, 0, 2, 2, 4, 4, 6, 6, 0], 127)


def test_quantizer_scale_matches_exact_ceil_near_the_boundary():
    """The official fp32 rule (amax * fp32(1/6), ceil from the bits) equals the exact ceil(log2(amax/6)) for
    every fp32 amax within 2^16 ulps of the boundary 6 (where the rounding of the product could matter; other
    octaves are exact power-of-two rescalings), plus a random sample of the octave [4, 8)."""
    six = torch.tensor(6.0).view(torch.int32).item()
    near = torch.arange(six - (1 << 16), six + (1 << 16), dtype=torch.int32)
    rand = torch.randint(129 << 23, 130 << 23, (1 << 14,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int64).to(torch.int32)
    amax = torch.cat([near, rand]).view(torch.float32)
    x = torch.zeros(amax.numel(), 32)
    x[:, 7] = -amax
    _, s = ref.indexer_fp4_quantize_keys(x)
    want = torch.where(amax.double() <= 6.0, 127, 128)
    assert torch.equal(s[:, 0].to(torch.int64), want.to(torch.int64))


def test_dequantize_matches_bruteforce():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 256, (3, 7, 32), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(100, 150, (3, 7, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales[0, 0, 0] = 0  # 2^-127: a subnormal scale
    got = ref.indexer_fp4_dequantize(codes, scales)
    assert got.shape == (3, 7, 64) and got.dtype == torch.float32
    for idx in [(0, 0), (1, 3), (2, 6)]:
        c = codes[idx].tolist()
        s = scales[idx].tolist()
        for d in range(64):
            nib = (c[d // 2] >> (4 * (d % 2))) & 0xF
            v = E2M1[nib & 7] * 2.0 ** (s[d // 32] - 127) * (-1 if nib & 8 else 1)
            assert got[idx][d].item() == v
    # Round trip: stored values are fixed points of quantize -> dequantize (a block whose largest code is below
    # full scale gets a smaller scale, but its values stay representable).
    x = torch.randn(5, 64, generator=g)
    c, s = ref.indexer_fp4_quantize_keys(x)
    y = ref.indexer_fp4_dequantize(c, s)
    c2, s2 = ref.indexer_fp4_quantize_keys(y)
    assert torch.equal(ref.indexer_fp4_dequantize(c2, s2), y)


# ---------------------------------------------------------------------------------------------------------
# op numerics
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_exact_inputs_match_reference_exactly(device, q_dtype):
    """Exactly representable scores: same indices in the same order, ties broken by the lower index."""
    cases = [(40, 8, 64, 128), (33, 5, 6, 64)] if device == "cpu" else [(3000, 512, 64, 128), (700, 100, 20, 128)]
    for N, topk, H, D in cases:
        nv = nvalid_rows(N, topk)
        B = len(nv)
        q, w, c, s = exact_inputs(B, N, H, D, q_dtype=q_dtype, seed=N + topk, device=device)
        n_valid = torch.tensor(nv, dtype=torch.int32, device=device)
        got = OP(q, w, c, s, n_valid, topk).cpu()
        want = ref.indexer_score_topk_ref(q.cpu(), w.cpu(), c.cpu(), s.cpu(), n_valid.cpu(), topk)
        assert torch.equal(got, want), (N, topk, H, D)


@pytest.mark.parametrize("device", DEVICES)
def test_massive_ties(device):
    """All-zero keys (score 0) and one repeated key (one score) dominate: the selection inside the tie group
    must be the lowest indices, across every radix level."""
    N, topk, H, D = (300, 16, 8, 128) if device == "cpu" else (20000, 512, 64, 128)
    q, w, c, s = exact_inputs(3, N, H, D, seed=9, zero_frac=0.0, dup_frac=0.0)
    c[0] = 0  # every score 0
    c[1] = c[1, 5]  # every key identical -> every score equal
    s[1] = s[1, 5]
    c[2, : N // 2] = 0  # half zeros, half random, with weights negative -> the zeros are the best
    w[2] = -1.0
    n_valid = torch.tensor([N, N - 3, N], dtype=torch.int64)
    args = [t.to(device) for t in (q, w, c, s, n_valid)]
    got = OP(*args, topk).cpu()
    want = ref.indexer_score_topk_ref(q, w, c, s, n_valid, topk)
    assert torch.equal(got, want)
    assert got[0].tolist() == list(range(topk)) and got[1].tolist() == list(range(topk))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_random_inputs_match_reference_within_tolerance(device, q_dtype):
    N, topk = (64, 8) if device == "cpu" else (5000, 512)
    nv = nvalid_rows(N, topk)
    q, w, c, s = random_inputs(len(nv), N, 64, 128, q_dtype=q_dtype, seed=3, device=device)
    n_valid = torch.tensor(nv, dtype=torch.int64, device=device)
    got = OP(q, w, c, s, n_valid, topk)
    scores = ref.indexer_scores_ref(q.cpu(), w.cpu(), c.cpu(), s.cpu())
    # fp32 sums in another order: ~1e-6 relative; CUDA splits fp32 q into two bf16 terms (2^-17 relative).
    assert_topk_close(got, scores, nv, topk, rtol=1e-5 if q_dtype == torch.bfloat16 else 5e-5)


# weights_scale / weights_dtype: the model's `weights_proj(x).to(bf16).float() * weight_scale`, done by the op.

MODEL_SCALE = 128**-0.5 * 64**-0.5  # V4's Indexer.weight_scale: not a power of two
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def tie_weights(B, H, dtype, seed):
    """fp32 weights exactly halfway between two neighbours in `dtype`, which round (to even) onto -1, 1/2, 1 or 2:
    half from above, half from below. Rounded, exact_inputs' scores stay exact; unrounded, the ties break."""
    g = torch.Generator().manual_seed(seed)
    t = torch.tensor([-1.0, 0.5, 1.0, 2.0])[torch.randint(0, 4, (B, H), generator=g)]
    ulp = t.abs() * 2.0 ** -MANTISSA_BITS[dtype]  # the spacing above a power of two (below it: half of that)
    below = torch.rand(B, H, generator=g) < 0.5
    w = torch.where(below, t - t.sign() * ulp / 4, t + t.sign() * ulp / 2)
    assert torch.equal(w.to(dtype).float(), t) and (w != t).all()
    return w


def rounding_rows(D, dtype, device):
    """2 rows, 2 heads, 2 keys; q[:, h] = e_h and each key is one unit vector, so a key's score is one head's
    weight. Row 0: key 0 scored by head 1 (weight 1), key 1 by head 0 (1 + half an ulp, rounds down to 1); row 1:
    key 0 by head 0 (1 - a quarter ulp, rounds up to 1), key 1 by head 1 (1). Rounded, both rows are exact ties
    (order [0, 1]); unrounded, both orders are [1, 0]."""
    ulp = 2.0 ** -MANTISSA_BITS[dtype]
    q = torch.zeros(2, 2, D, dtype=torch.bfloat16)
    q[:, 0, 0] = q[:, 1, 1] = 1.0
    w = torch.tensor([[1.0 + ulp / 2, 1.0], [1.0 - ulp / 4, 1.0]])
    codes = torch.zeros(2, 2, D // 2, dtype=torch.uint8)
    codes[0, 0, 0], codes[0, 1, 0] = 0x20, 0x02  # code 2 (= 1.0) in element 1 / element 0
    codes[1, 0, 0], codes[1, 1, 0] = 0x02, 0x20
    scales = torch.full((2, 2, D // 32), 127, dtype=torch.uint8)  # 2^0
    return [t.to(device) for t in (q, w, codes, scales)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_dtype_and_scale(device, dtype):
    """The op's rounding + scaling equals the op on the pre-rounded, pre-scaled weights (the model's fp32 ops) and
    the reference, ties included; a missing rounding would reorder rounding_rows."""
    N, topk = (40, 8) if device == "cpu" else (3000, 512)
    nv = nvalid_rows(N, topk)
    B = len(nv)
    n_valid = torch.tensor(nv, dtype=torch.int32, device=device)
    q, _, c, s = exact_inputs(B, N, 64, 128, seed=30, device=device)
    w = tie_weights(B, 64, dtype, seed=31).to(device)
    for scale in (1.0, 0.25):  # dyadic: the scores stay exact, so the reference must agree bit for bit
        got = OP(q, w, c, s, n_valid, topk, weights_scale=scale, weights_dtype=dtype)
        assert torch.equal(got, OP(q, w.to(dtype).float() * scale, c, s, n_valid, topk)), scale
        want = ref.indexer_score_topk_ref(q.cpu(), w.cpu(), c.cpu(), s.cpu(), n_valid.cpu(), topk,
                                                weights_scale=scale, weights_dtype=dtype)
        assert torch.equal(got.cpu(), want), scale

    # random inputs, V4's scale: the same fp32 weights as the model's `proj.to(dtype).float() * scale`
    q, w, c, s = random_inputs(B, N, 64, 128, seed=32, device=device)
    w = w * 37.0  # weights_proj outputs are O(1) and beyond
    got = OP(q, w, c, s, n_valid, topk, MODEL_SCALE, dtype)
    assert torch.equal(got, OP(q, w.to(dtype).float() * MODEL_SCALE, c, s, n_valid, topk))
    assert not torch.equal(w.to(dtype).float(), w)

    q, w, c, s = rounding_rows(128, dtype, device)
    nv2 = torch.tensor([2, 2], dtype=torch.int64, device=device)
    got = OP(q, w, c, s, nv2, 2, weights_scale=MODEL_SCALE, weights_dtype=dtype)
    assert got.tolist() == [[0, 1], [0, 1]]
    want = ref.indexer_score_topk_ref(q.cpu(), w.cpu(), c.cpu(), s.cpu(), nv2.cpu(), 2, MODEL_SCALE, dtype)
    assert torch.equal(got.cpu(), want)
    assert OP(q, w, c, s, nv2, 2, weights_scale=MODEL_SCALE).tolist() == [[1, 0], [1, 0]]


def test_model_select_rounds_and_scales_in_the_op():
    """Indexer.select on decode's fp32 weights_proj product (Attention._fp32_projections) selects exactly what
    the model selected when it did `.to(bf16).float() * weight_scale` in PyTorch, and nothing runs between that
    product and the op (no pointwise kernel in the compiled step)."""
    from dsv4_model.checkpoint.writer import TINY_CONFIG
    from dsv4_model.model.config import ModelConfig
    from dsv4_model.model.indexer import Indexer
    from dsv4_model.model.layers import fp32_linear

    cfg = ModelConfig(**{**TINY_CONFIG, "index_head_dim": 64, "index_n_heads": 64}).validate()
    B, k = 2, 16
    ix = Indexer(cfg, 4, torch.bfloat16, max_batch=B, max_seq_len=256)
    ix.alloc_runtime("cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(40)
    ix.weights_proj.weight.copy_(torch.randn(ix.weights_proj.weight.shape, generator=g))
    ix.store_prefill(torch.randn(B, ix.n_entries, ix.head_dim, generator=g).to(torch.bfloat16))
    assert ix.packed_decode()
    x = torch.randn(B, cfg.dim, generator=g).to(torch.bfloat16)
    q = torch.randn(B, ix.n_heads, ix.head_dim, generator=g).to(torch.bfloat16)
    n_vis = torch.tensor([ix.n_entries, 40])
    proj = fp32_linear(x, [ix.weights_proj.weight])[0]
    assert proj.dtype == torch.float32 and not torch.equal(proj.to(torch.bfloat16).float(), proj)

    got = ix.select(q, x, n_vis, k, proj)
    before = OP(q, proj.to(torch.bfloat16).float() * ix.weight_scale, ix.k_codes[:B], ix.k_scales[:B], n_vis, k)
    assert torch.equal(got, before)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(lambda q, x, n, p: ix.select(q, x, n, k, p), backend=backend, fullgraph=True)(q, x, n_vis, proj)
    (gm,) = graphs
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and "indexer_score_topk" in str(n.target)]
    weights = node.args[1] if len(node.args) > 1 else node.kwargs["weights"]
    assert weights.op == "placeholder", f"weights computed in the graph: {weights.format_node()}"


def test_small_N_and_topk_edge_cases_cpu():
    for N, topk, nv in [(5, 8, [0, 3, 5]), (1, 1, [1, 0, 1]), (0, 4, [0, 2, 0]), (6, 0, [6, 2, 1])]:
        q, w, c, s = exact_inputs(len(nv), N, 4, 32, seed=N)
        n_valid = torch.tensor(nv, dtype=torch.int32)
        got = OP(q, w, c, s, n_valid, topk)
        want = ref.indexer_score_topk_ref(q, w, c, s, n_valid, topk)
        assert got.shape == (len(nv), topk)
        assert torch.equal(got, want), (N, topk, nv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_kv_batch_scores_each_rows_sequence(device, q_dtype):
    """kv_batch = S: query row b (T tokens of S sequences, token-major) scores sequence b % S's keys -- the same
    indices as the call on the keys repeated T times, and the reference; opcheck."""
    T, S = 3, 2
    N, topk, H, D = (40, 8, 64, 128) if device == "cpu" else (3000, 512, 64, 128)
    q, w, c, s = exact_inputs(T * S, N, H, D, q_dtype=q_dtype, seed=11, device=device)
    c, s = c[:S], s[:S]  # the sequences' keys; the queries' rows are T tokens of each
    n_valid = torch.tensor([N, 7, N - 1, 0, 37, N + 3], dtype=torch.int64, device=device)
    got = OP(q, w, c, s, n_valid, topk, kv_batch=S)
    want = OP(q, w, c.repeat(T, 1, 1), s.repeat(T, 1, 1), n_valid, topk)
    assert torch.equal(got, want)
    assert torch.equal(got.cpu(), ref.indexer_score_topk_ref(q.cpu(), w.cpu(), c.cpu(), s.cpu(), n_valid.cpu(), topk,
                                                             kv_batch=S))
    torch.library.opcheck(OP.default, (q, w, c, s, n_valid, topk), dict(kv_batch=S))
    with pytest.raises(RuntimeError, match="kv_batch must be 0 or divide B = 6, got 4"):
        OP(q, w, c, s, n_valid, topk, kv_batch=4)
    with pytest.raises(RuntimeError, match="k_codes must be \\[kv_batch, N, D/2\\] = \\[3"):
        OP(q, w, c, s, n_valid, topk, kv_batch=3)


def test_input_validation_cpu():
    q, w, c, s = exact_inputs(2, 10, 4, 64)
    nv = torch.tensor([10, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="weights must be float32"):
        OP(q, w.double(), c, s, nv, 4)
    with pytest.raises(RuntimeError, match="k_scales must be"):
        OP(q, w, c, s[:, :, :1], nv, 4)
    with pytest.raises(RuntimeError, match="n_valid must be int32 or int64"):
        OP(q, w, c, s, nv.float(), 4)
    with pytest.raises(RuntimeError, match="k_codes must be"):
        OP(q, w, c[:, :, :16], s, nv, 4)
    with pytest.raises(RuntimeError, match="weights_dtype must be bfloat16, float16 or None, got Int"):
        OP(q, w, c, s, nv, 4, weights_dtype=torch.int32)
    with pytest.raises(RuntimeError, match="weights_dtype must be bfloat16, float16 or None"):
        OP(q, w, c, s, nv, 4, 0.5, torch.float32)


def test_fake_rejects_bad_weights_dtype():
    q, w, c, s = exact_inputs(2, 10, 4, 64, device="meta")
    nv = torch.empty(2, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match="weights_dtype must be bfloat16, float16 or None"):
        OP(q, w, c, s, nv, 4, weights_dtype=torch.int32)


# ---------------------------------------------------------------------------------------------------------
# op plumbing: opcheck, fake, torch.compile, CUDA graphs
# ---------------------------------------------------------------------------------------------------------


def _opcheck_samples(device):
    """(args, kwargs) pairs."""
    q, w, c, s = exact_inputs(3, 40, 64, 128, device=device, seed=4)
    q2, w2, c2, s2 = random_inputs(2, 9, 64, 128, q_dtype=torch.float32, device=device, seed=5)
    nv = torch.tensor([40, 7, 0], dtype=torch.int32, device=device)
    nv2 = torch.tensor([9, 3], dtype=torch.int64, device=device)
    return [
        ((q, w, c, s, nv, 8), {}),
        ((q2, w2, c2, s2, nv2, 16), {}),
        ((q, tie_weights(3, 64, torch.bfloat16, seed=6).to(device), c, s, nv, 8),
         dict(weights_scale=MODEL_SCALE, weights_dtype=torch.bfloat16)),
        ((q2, w2 * 37.0, c2, s2, nv2, 16, 0.5, torch.float16), {}),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args, kwargs in _opcheck_samples(device):
        torch.library.opcheck(OP.default, args, kwargs)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def args(device):
        return (
            torch.empty(3, 64, 128, dtype=torch.bfloat16, device=device),
            torch.empty(3, 64, device=device),
            torch.empty(3, 1000, 64, dtype=torch.uint8, device=device),
            torch.empty(3, 1000, 4, dtype=torch.uint8, device=device),
            torch.empty(3, dtype=torch.int32, device=device),
        )

    meta = OP(*args("meta"), 512)
    assert meta.shape == (3, 512) and meta.dtype == torch.int32 and meta.device.type == "meta"
    with FakeTensorMode():
        fake = OP(*args("cpu"), 1024)
    assert fake.shape == (3, 1024) and fake.dtype == torch.int32


def test_compiled_fullgraph_cpu():
    from torch._dynamo.utils import counters

    def step(q, w, c, s, nv):
        return OP(q * 1.0, w, c, s, nv + 0, 8)

    def step_lowp(q, w, c, s, nv):
        return OP(q * 1.0, w, c, s, nv + 0, 8, weights_scale=0.25, weights_dtype=torch.bfloat16)

    q, w, c, s = exact_inputs(3, 50, 8, 64, seed=6)
    nv = torch.tensor([50, 20, 8], dtype=torch.int32)
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    got = compiled(q, w, c, s, nv)
    assert not counters["graph_break"]
    assert torch.equal(got, step(q, w, c, s, nv))
    assert torch.equal(got, ref.indexer_score_topk_ref(q, w, c, s, nv, 8))
    w = tie_weights(3, 8, torch.bfloat16, seed=7)
    got = torch.compile(step_lowp, fullgraph=True, dynamic=False)(q, w, c, s, nv)
    assert not counters["graph_break"]
    assert torch.equal(got, step_lowp(q, w, c, s, nv))
    assert torch.equal(got, ref.indexer_score_topk_ref(q, w, c, s, nv, 8, 0.25, torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_large_n_paths():
    """N beyond the top-k kernel's shared-memory cache (> 8 * 40960 keys) and topk = 1024 / 4096."""
    for N, topk in [(400000, 1024), (50000, 4096)]:
        nv = [N, N - 12345]
        q, w, c, s = random_inputs(2, N, 64, 128, seed=N, device="cuda")
        n_valid = torch.tensor(nv, dtype=torch.int32, device="cuda")
        got = OP(q, w, c, s, n_valid, topk)
        scores = ref.indexer_scores_ref(q, w, c, s)  # on the GPU: the reference is plain torch
        assert_topk_close(got, scores, nv, topk, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_equals_cpu_on_exact_inputs():
    N, topk = 2500, 512
    nv = nvalid_rows(N, topk)
    q, w, c, s = exact_inputs(len(nv), N, 64, 128, seed=12)
    n_valid = torch.tensor(nv, dtype=torch.int64)
    want = OP(q, w, c, s, n_valid, topk)
    got = OP(q.cuda(), w.cuda(), c.cuda(), s.cuda(), n_valid.cuda(), topk).cpu()
    assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_with_new_data():
    B, N, H, D, topk = 4, 3000, 64, 128, 512
    bufs = exact_inputs(B, N, H, D, seed=20, device="cuda")
    n_valid = torch.tensor([N, 100, 600, 0], dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        OP(*bufs, n_valid, topk)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*bufs, n_valid, topk)
    for seed, nv in [(21, [N, 513, 512, 1]), (22, [7, N, 2000, 511])]:
        new = exact_inputs(B, N, H, D, seed=seed, device="cuda")
        for dst, src in zip(bufs, new):
            dst.copy_(src)
        n_valid.copy_(torch.tensor(nv, dtype=torch.int32))
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            eager = OP(*bufs, n_valid, topk)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(out, eager)
        want = ref.indexer_score_topk_ref(*[t.cpu() for t in bufs], n_valid.cpu(), topk)
        assert torch.equal(out.cpu(), want)


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_limits_are_reported():
    q, w, c, s = exact_inputs(2, 10, 4, 64, device="cuda")
    nv = torch.tensor([10, 10], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="supports D = 128"):
        OP(q, w, c, s, nv, 4)
    q, w, c, s = exact_inputs(2, 10, 4, 128, device="cuda")
    with pytest.raises(RuntimeError, match="topk <= 4096"):
        OP(q, w, c, s, nv, 4097)
    with pytest.raises(RuntimeError, match="weights_dtype must be bfloat16, float16 or None, got Int"):
        OP(q, w, c, s, nv, 4, weights_dtype=torch.int32)
    assert OP(q, w, c, s, nv, 0).shape == (2, 0)
