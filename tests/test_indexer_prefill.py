"""dsv4::indexer_prefill_scores (the lightning indexer's scores over a prefill chunk): against the reference (the
model's torch form) exactly on inputs whose every product and partial sum is exact in fp32, within a summation-order
bound on random ones; -inf past each query's visible keys, whole invisible key tiles included; opcheck, fake,
argument errors; the model's prefill through the op gives the torch form's logits."""
import pytest
import torch

import dsv4_ops  # noqa: F401  (loads the library and the fakes)
from dsv4_ops import ops, reference as ref
from dsv4_ops.overrides import kernel_overrides

OP = torch.ops.dsv4.indexer_prefill_scores
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


def _inputs(B, S, H, D, T, *, exact=False, seed=0, device="cpu", dtype=torch.bfloat16, start=None, ratio=4):
    """q [B, S, H, D], weights [B, S, H], keys [B, T, D], n_visible [B, S] as a prefill chunk sees them: query s of
    row b at position start[b] + s sees the (start[b] + s + 1) // ratio entries closed by then. exact: small
    integers and dyadic weights (every score exact in fp32, so any summation order agrees)."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        q = torch.randint(-3, 4, (B, S, H, D), generator=g).float()
        k = torch.randint(-3, 4, (B, T, D), generator=g).float()
        w = torch.randint(-8, 9, (B, S, H), generator=g).float() / 8
    else:
        q = torch.randn(B, S, H, D, generator=g)
        k = torch.randn(B, T, D, generator=g) * torch.exp(torch.randn(B, T, 1, generator=g))
        w = torch.randn(B, S, H, generator=g) * H**-0.5
    start = torch.zeros(B, dtype=torch.long) if start is None else torch.as_tensor(start)
    nv = ((start.view(B, 1) + torch.arange(S) + 1) // ratio).clamp(max=T)
    return [t.to(device) for t in (q.to(dtype), w, k.to(dtype), nv)]


def _bound(q, w, k):
    """Summation-order bound per score: a few ulps of sum_h |w| * sum_d |q| |k|."""
    mag = torch.einsum("bshd,btd->bsht", q.float().abs(), k.float().abs())
    return (mag * w.abs().unsqueeze(-1)).sum(2) * 2e-6 + 1e-30


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,S,H,D,T,start", [(2, 70, 64, 128, 300, [0, 517]), (1, 130, 3, 128, 129, [40]),
                                               (1, 5, 64, 128, 1000, [3990])])
def test_exact_inputs_equal_the_reference(device, B, S, H, D, T, start):
    """Tiles past S / T, a row that sees every key, one that sees few, tiles no query sees (-inf, no products)."""
    args = _inputs(B, S, H, D, T, exact=True, device=device, start=start)
    got = OP(*args)
    want = ref.indexer_prefill_scores_ref(*args)
    assert got.dtype == torch.float32 and got.shape == (B, S, T)
    assert torch.equal(got, want)
    assert bool(torch.isneginf(got).any()) and bool(torch.isfinite(got).any())


@pytest.mark.parametrize("device", DEVICES)
def test_random_inputs_within_summation_order(device):
    args = _inputs(2, 96, 64, 128, 256, seed=1, device=device, start=[100, 700])
    got, want = OP(*args), ref.indexer_prefill_scores_ref(*args)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert bool(((got - want).abs()[fin] <= _bound(*args[:3])[fin]).all())


def test_cpu_takes_fp32_and_any_width():
    """The CPU kernel takes what the reference takes: fp32 q / keys, any head width and count."""
    args = _inputs(2, 9, 5, 24, 13, exact=True, dtype=torch.float32, start=[0, 20], ratio=2)
    assert torch.equal(OP(*args), ref.indexer_prefill_scores_ref(*args))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.library.opcheck(OP.default, tuple(_inputs(1, 20, 4, 128, 40, device=device, start=[30])))


def test_fake_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 7, 64, 128, dtype=torch.bfloat16)
        out = OP(q, torch.empty(2, 7, 64), torch.empty(2, 33, 128, dtype=torch.bfloat16),
                 torch.empty(2, 7, dtype=torch.long))
    assert out.shape == (2, 7, 33) and out.dtype == torch.float32


@pytest.mark.parametrize("change,msg", [
    (lambda a: [a[0][0]] + a[1:], r"q must be \[B, S, H, D\]"),
    (lambda a: [a[0], a[1][..., :1]] + a[2:], r"weights must be \[B, S, H\]"),
    (lambda a: [a[0], a[1].double()] + a[2:], "weights must be float32"),
    (lambda a: a[:2] + [a[2].float(), a[3]], "keys must have q's dtype"),
    (lambda a: a[:2] + [a[2][..., :64], a[3]], r"keys must be \[B, T, D\]"),
    (lambda a: a[:3] + [a[3].int()], "n_visible must be int64"),
    (lambda a: a[:3] + [a[3][:, :2]], r"n_visible must be \[B, S\]"),
])
def test_bad_arguments_name_the_argument(change, msg):
    args = _inputs(1, 4, 2, 128, 8)
    with pytest.raises(RuntimeError, match=msg):
        OP(*change(args))


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_refuses_what_it_does_not_take():
    args = _inputs(1, 4, 2, 64, 8, device="cuda")
    with pytest.raises(RuntimeError, match="supports D = 128"):
        OP(*args)
    args = _inputs(1, 4, 2, 128, 8, device="cuda", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="takes bfloat16"):
        OP(*args)


def test_model_prefill_through_the_op(monkeypatch):
    """A bf16 model with CSA layers: prefill chunks through the op (forced on the CPU) give the torch form's
    logits (the same scores up to summation order: equal top-k here) and the same caches."""
    from dsv4_model.checkpoint.writer import make_config
    from dsv4_model.model import attention as attention_mod
    from dsv4_model.model.transformer import Transformer
    from dsv4_model.quant.random_model import init_random_weights

    cfg = make_config("tiny")
    ids = torch.randint(0, cfg.vocab_size, (2, 50), generator=torch.Generator().manual_seed(0))

    def run(use_op: bool):
        monkeypatch.setattr(attention_mod.supports, "indexer_prefill_scores", lambda *a: use_op)
        calls = []
        real = ops.indexer_prefill_scores
        monkeypatch.setattr(attention_mod.ops, "indexer_prefill_scores",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
        m = init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=128, dtype=torch.bfloat16), 0).eval()
        with torch.no_grad():
            first = m.prefill(ids[:, :30], torch.tensor([30, 22]))
            second = m.prefill(ids[:, 30:], torch.tensor([20, 20]), start=torch.tensor([30, 22]))
        return first, second, {n: b.clone() for n, b in m.named_buffers()}, len(calls)

    a1, a2, abuf, acalls = run(False)
    b1, b2, bbuf, bcalls = run(True)
    assert acalls == 0 and bcalls > 0
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    assert all(torch.equal(abuf[n], bbuf[n]) for n in abuf)


@pytest.mark.parametrize("device", DEVICES)
def test_negative_and_huge_visible_counts(device):
    """n_visible below 0 (any int64, -2^40 included) scores nothing; above T scores every key."""
    q, w, k, nv = _inputs(1, 4, 2, 128, 40, exact=True, device=device)
    nv = torch.tensor([[-5, -2**40, 2**40, 7]], device=device)
    got = OP(q, w, k, nv)
    assert torch.equal(got, ref.indexer_prefill_scores_ref(q, w, k, nv))
    assert bool(torch.isneginf(got[0, :2]).all()) and bool(torch.isfinite(got[0, 2]).all())


# ---------------------------------------------------------------------------------------------------------
# dsv4::indexer_topk: the top-k of those scores
# ---------------------------------------------------------------------------------------------------------
TOPK = torch.ops.dsv4.indexer_topk


def _scores_with_ties(shape, seed=0, device="cpu"):
    """fp32 scores as prefill gives them: a coarse grid (many exact ties), +0 and -0, and -inf past a visible count
    that varies by row (some rows see fewer entries than the top-k takes)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-20, 21, shape, generator=g).float() / 4
    s = torch.where(torch.rand(shape, generator=g) < 0.05, torch.tensor(-0.0), s)
    n = shape[-1]
    vis = torch.randint(1, n + 1, shape[:-1], generator=g)
    s = s.masked_fill(torch.arange(n) >= vis.unsqueeze(-1), float("-inf"))
    return s.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,k", [((2, 37, 300), 64), ((1, 5, 1000), 512), ((3, 129), 129), ((4, 1), 1),
                                     ((2, 3, 4100), 4096)])
def test_topk_equals_the_reference_and_the_model_form(device, shape, k):
    """Each row's indices by (score desc, index asc), -0 == +0, ties and -inf included: the stable-sort reference and
    the model's torch form (topk_indices, torch.topk of the composite) give the same indices in the same order."""
    from dsv4_model.model.indexer import topk_indices

    s = _scores_with_ties(shape, seed=k, device=device)
    got = TOPK(s, k)
    assert got.dtype == torch.int64 and got.shape == (*shape[:-1], k)
    assert torch.equal(got.cpu(), ref.indexer_topk_ref(s.cpu(), k))
    assert torch.equal(got, topk_indices(s, k))


@pytest.mark.parametrize("device", DEVICES)
def test_topk_opcheck(device):
    for k in (1, 7):
        torch.library.opcheck(TOPK.default, (_scores_with_ties((3, 40), seed=k, device=device), k))


def test_topk_bad_arguments_name_the_argument():
    s = torch.randn(2, 10)
    for bad, msg in (((s.double(), 3), "scores must be float32"), ((s, 0), "topk must be in"),
                     ((s, 11), "topk must be in"), ((torch.randn(2, 0), 1), "N >= 1")):
        with pytest.raises(RuntimeError, match=msg):
            TOPK(*bad)
    assert ops.indexer_topk(s, 2).shape == (2, 2)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert TOPK(torch.empty(4, 9, 33), 5).shape == (4, 9, 5)


TOPK_KERNELS = ["auto", "cluster", "rows"]


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("kernel", TOPK_KERNELS)
def test_topk_cuda_prefill_sizes(kernel):
    """A prefill chunk's shape (8192 queries over 8192 entries, top-512; most rows cached in shared memory, long
    rows not), rows beyond one launch's 65535, and the decode limit refused; on each kernel."""
    with kernel_overrides(topk_kernel=kernel):
        s = _scores_with_ties((1, 8192, 8192), seed=3, device="cuda")
        assert torch.equal(TOPK(s, 512), ref.indexer_topk_ref(s, 512))
        s = _scores_with_ties((2, 40000, 600), seed=4, device="cuda")
        assert torch.equal(TOPK(s, 512), ref.indexer_topk_ref(s, 512))
        s = torch.randn(3, 70000, device="cuda")  # a row longer than the shared-memory cache
        assert torch.equal(TOPK(s, 300), ref.indexer_topk_ref(s, 300))
        with pytest.raises(RuntimeError, match="topk <= 4096"):
            TOPK(torch.randn(2, 5000, device="cuda"), 4097)


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("kernel", TOPK_KERNELS[1:])
@pytest.mark.parametrize("shape,k", [((2, 37, 300), 64), ((1, 5, 1000), 512), ((3, 129), 129), ((4, 1), 1),
                                     ((2, 3, 4100), 4096), ((600, 2048), 512), ((64, 20000), 512),
                                     ((5, 50000), 4096)])
def test_topk_cuda_kernels_equal_the_reference(kernel, shape, k):
    """Each forced kernel against the stable-sort reference: ties, -0, -inf past a visible count, k = N, one
    entry, short rows (256 threads), long rows (1024 threads) cached in shared memory and not."""
    s = _scores_with_ties(shape, seed=k + shape[-1], device="cuda")
    with kernel_overrides(topk_kernel=kernel):
        got = TOPK(s, k)
    assert torch.equal(got.cpu(), ref.indexer_topk_ref(s.cpu(), k))
