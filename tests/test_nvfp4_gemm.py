"""dsv4::nvfp4_linear / nvfp4_linear_grouped / nvfp4_linear_multi / nvfp4_fp32_linear_multi / nvfp4_linear_w4a4 /
nvfp4_moe / nvfp4_moe_rows
against the dequantize-then-matmul references (dsv4_ops/reference/), the kernel weight layout
(dsv4_model/quant/nvfp4.py), and the NVFP4 modules.

Tolerance of a bf16 output: |out - ref32| <= ulp_bf16(ref32) + 2 * 2e-5 * sum_k |x_k w_k|, i.e. one bf16 rounding
of a value whose fp32 accumulation may differ from the reference's by reordering (and, on the GPU, the
tensor-core accumulation) -- far below the effect of a single wrong weight, block scale or token.
"""
import pytest
import torch

import dsv4_ops
from dsv4_ops import reference as ref
from dsv4_ops.overrides import kernel_overrides
from dsv4_model.quant import nvfp4 as nv
from dsv4_model.quant.nvfp4_modules import Nvfp4MoE, dequantized_weight, nvfp4_linear

ops = torch.ops.dsv4

_ALL_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_POS_E4M3 = _ALL_E4M3[torch.isfinite(_ALL_E4M3) & (_ALL_E4M3 > 0)]
_NORMAL = _POS_E4M3[(_POS_E4M3 >= 2.0**-4) & (_POS_E4M3 <= 16.0)]
_SUBNORMAL = _POS_E4M3[_POS_E4M3 < 2.0**-6]


def rand_scales(shape, gen, device="cpu"):
    """E4M3 block scales, mostly normal, with subnormal, zero and negative ones mixed in."""
    s = _NORMAL[torch.randint(0, len(_NORMAL), shape, generator=gen)]
    u = torch.rand(shape, generator=gen)
    s = torch.where(u < 0.03, _SUBNORMAL[torch.randint(0, len(_SUBNORMAL), shape, generator=gen)], s)
    s = torch.where((u >= 0.03) & (u < 0.05), torch.zeros_like(s), s)
    s = torch.where((u >= 0.05) & (u < 0.08), -s, s)
    return s.to(torch.float8_e4m3fn).to(device)


def rand_nvfp4(lead, n, k, gen, device="cpu"):
    """Canonical NVFP4 (packed, e4m3 scales, fp32 global scale of shape `lead`) with random codes."""
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.uint8).to(device)
    scale = rand_scales((*lead, n, k // 16), gen, device)
    gs = (0.005 + 0.02 * torch.rand(lead, generator=gen)).to(device)
    return packed, scale, gs


def rand_x(shape, gen, device="cpu"):
    return torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    e = torch.frexp(v)[1]  # |v| in [2^(e-1), 2^e): bf16 spacing 2^(e-8)
    return torch.where(v == 0, torch.zeros_like(v), torch.ldexp(torch.ones_like(v), (e - 8).float()))


def assert_bf16_close(out, ref32, bound, what, rel=2e-5):
    assert out.shape == ref32.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref32.shape)}"
    err = (out.float() - ref32).abs()
    tol = bf16_ulp(ref32) + 2 * rel * bound + 1e-30
    bad = ~(err <= tol)
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {bad.numel()} outside tolerance, "
                                 f"max err/tol {float((err / tol).max()):.3g}")


def linear_case(n, k, m, gen, device):
    packed, scale, gs = rand_nvfp4((), n, k, gen, device)
    wk, sk = nv.repack_weight(packed, scale)
    x = rand_x((m, k), gen, device)
    w = ref.nvfp4_gemm_dequant_ref(packed, scale, gs)
    ref32 = x.float() @ w.t()
    bound = x.float().abs() @ w.abs().t()
    return x, (wk, sk, gs), ref32, bound


def grouped_case(g, n, k, lead, gen, device):
    """x [*lead, G, K], G canonical matrices in the kernel layout, fp32 reference and error bound [*lead, G, N]."""
    packed, scale, gs = rand_nvfp4((g,), n, k, gen, device)
    wk, sk = nv.repack_weight(packed, scale)
    x = rand_x((*lead, g, k), gen, device)
    w = ref.nvfp4_gemm_dequant_ref(packed, scale, gs)  # [G, N, K]
    ref32 = torch.einsum("...gk,gnk->...gn", x.float(), w)
    bound = torch.einsum("...gk,gnk->...gn", x.float().abs(), w.abs())
    return x, (wk, sk, gs), (packed, scale, gs), ref32, bound


def kernel_choice(name):
    return kernel_overrides(nvfp4_gemm_kernel=name)


# ------------------------------------------------------------------------------------------- layout
@pytest.mark.parametrize("n", [5, 37])
def test_layout_roundtrip_and_decode_tricks(n):
    """repack/unrepack are inverse, and the bit tricks the CUDA kernel uses (mirrored here) decode every code of
    the kernel layout to the canonical value times 2^-126 in the mma A-fragment order. n = 37: two tile-major
    16-row tiles (each chunk of a tile one contiguous 1 KB / 128 B) and a row-major partial tile."""
    gen = torch.Generator().manual_seed(1)
    k = 272
    packed, scale, _ = rand_nvfp4((), n, k, gen)
    wk, sk = nv.repack_weight(packed, scale)
    rows_w, rows_s = nv.row_major(wk, 64), nv.row_major(sk, 8)
    assert torch.equal(nv.tile_major(rows_w, 64), wk) and torch.equal(nv.tile_major(rows_s, 8), sk)
    if n >= 16:  # tile 0's chunk 1 = rows 0..15's bytes 64..127, in row order
        assert torch.equal(wk[:16].flatten()[1024:2048].view(16, 64), rows_w[:16, 64:128])
        assert torch.equal(sk[:16].flatten()[128:256].view(16, 8), rows_s[:16, 8:16])
    assert torch.equal(wk[32:], rows_w[32:]) and torch.equal(sk[32:], rows_s[32:])
    assert wk.shape == (n, 384 // 2) and sk.shape == (n, 384 // 16)
    one = torch.tensor(1.0)
    canon = ref.nvfp4_gemm_dequant_ref(packed, scale, one)
    assert torch.equal(nv.dequantize_kernel_layout(wk, sk, one, k), canon)
    p2, s2 = nv.unrepack_weight(wk, sk, k)
    assert torch.equal(ref.nvfp4_gemm_dequant_ref(p2, s2, one), canon)

    words = rows_w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [n, C * 16]: (chunk, lane t, word j)
    m32 = 0xFFFFFFFF
    regs = [words & 0x81C081C0, (words << 3) & 0x81C081C0 & m32, (words << 6) & 0x81C081C0 & m32,
            ((words >> 4) & 0x00C000C0) | ((words >> 5) & 0x01000100) | ((words << 1) & 0x80008000)]
    sc = nv.decode_scale(rows_s)
    got = torch.zeros(n, 384)
    for q, r in enumerate(regs):
        for e in range(2):
            half = ((r >> (16 * e)) & 0xFFFF).to(torch.int32)
            val = (half << 16).view(torch.float32) * 2.0**126  # bf16 bits -> fp32
            c, t, j = torch.meshgrid(torch.arange(3), torch.arange(4), torch.arange(4), indexing="ij")
            s, h = 2 * j + (q >> 1), q & 1
            kk = (c * 128 + 16 * s + 8 * h + 2 * t + e).reshape(-1)
            blk = (c * 8 + s).reshape(-1)
            got[:, kk] = val * sc[:, blk]
    assert torch.equal(got[:, :k], canon)
    assert torch.equal(got[:, k:], torch.zeros(n, 384 - k))


def test_scale_encoding_covers_e4m3():
    v = _ALL_E4M3[torch.isfinite(_ALL_E4M3)].abs()
    b = nv.encode_scale(v)
    assert torch.equal(nv.decode_scale(b), v)
    # the CUDA kernel turns a byte into the bf16 of scale * 2^119 as (byte << 4) + (236 << 7)
    nz = b[b > 0].to(torch.int32)
    bits = (nz << 4) + (236 << 7)
    assert int(bits.max()) < 0x7F80
    assert torch.equal((bits << 16).view(torch.float32), v[b > 0] * 2.0**119)


def test_gate_up_interleave_roundtrip():
    t = torch.arange(2 * 48 * 3).reshape(2, 48, 3)
    it = nv.interleave_gate_up(t)
    assert torch.equal(it[0, :8], t[0, :8]) and torch.equal(it[0, 8:16], t[0, 24:32])
    assert torch.equal(nv.deinterleave_gate_up(it), t)


# ------------------------------------------------------------------------------------------- CPU numerics
@pytest.mark.parametrize("n,k", [(32, 128), (40, 272), (16, 1024)])
@pytest.mark.parametrize("m", [1, 3, 8, 64, 513])
def test_linear_cpu(n, k, m):
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    x, w, ref32, bound = linear_case(n, k, m, gen, "cpu")
    assert_bf16_close(ops.nvfp4_linear(x, *w), ref32, bound, f"cpu linear {m}x{n}x{k}")


@pytest.mark.parametrize("n,k,m", [(1024, 4096, 1), (1024, 4096, 3), (1536, 7168, 1)])
def test_linear_cpu_v4_shapes(n, k, m):
    gen = torch.Generator().manual_seed(7)
    x, w, ref32, bound = linear_case(n, k, m, gen, "cpu")
    assert_bf16_close(ops.nvfp4_linear(x, *w), ref32, bound, f"cpu linear {m}x{n}x{k}")


def check_linear_out_dtypes(device, ms):
    """out_dtype fp32 / fp16: the fp32 sums written as they are (fp32) or rounded once; bf16 (the default) is the
    fp32 output rounded once, so the three agree bit for bit after rounding; fp32 within the sums' order of the
    exact product."""
    gen = torch.Generator().manual_seed(11)
    for m in ms:
        x, w, ref32, bound = linear_case(40, 272, m, gen, device)
        out32 = ops.nvfp4_linear(x, *w, torch.float32)
        assert out32.dtype == torch.float32 and out32.shape == (m, 40)
        assert torch.equal(out32.to(torch.bfloat16), ops.nvfp4_linear(x, *w))
        assert torch.equal(ops.nvfp4_linear(x, *w, torch.bfloat16), ops.nvfp4_linear(x, *w))
        assert torch.equal(out32.to(torch.float16), ops.nvfp4_linear(x, *w, torch.float16))
        torch.testing.assert_close(out32, ref32, atol=1e-5 * float(bound.max()), rtol=1e-5)
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16, float16 or float32"):
        ops.nvfp4_linear(x, *w, torch.int32)


def test_linear_out_dtype_cpu():
    check_linear_out_dtypes("cpu", (1, 5, 70))


def test_linear_cpu_batched_input_and_reference():
    gen = torch.Generator().manual_seed(3)
    packed, scale, gs = rand_nvfp4((), 24, 160, gen)
    wk, sk = nv.repack_weight(packed, scale)
    x = rand_x((2, 3, 160), gen)
    out = ops.nvfp4_linear(x, wk, sk, gs)
    assert out.shape == (2, 3, 24) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.nvfp4_linear_ref(x, packed, scale, gs), atol=0, rtol=2**-7)


def w4a4_case(n, k, lead, gen, device):
    xp, xs, xg = rand_nvfp4((), int(torch.tensor(lead).prod()), k, gen, device)
    xp, xs = xp.reshape(*lead, k // 2), xs.reshape(*lead, k // 16)
    packed, scale, gs = rand_nvfp4((), n, k, gen, device)
    wk, sk = nv.repack_weight(packed, scale)
    xd = ref.nvfp4_gemm_dequant_ref(xp, xs, xg)
    w = ref.nvfp4_gemm_dequant_ref(packed, scale, gs)
    return (xp, xs, xg), (wk, sk, gs), xd @ w.t(), xd.abs() @ w.abs().t()


@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_linear_w4a4_cpu(m, out_dtype):
    gen = torch.Generator().manual_seed(11 + m)
    xq, w, ref32, bound = w4a4_case(48, 272, (m,), gen, "cpu")
    out = ops.nvfp4_linear_w4a4(*xq, *w, out_dtype)
    assert out.dtype == out_dtype
    if out_dtype == torch.bfloat16:
        assert_bf16_close(out, ref32, bound, f"cpu w4a4 m={m}")
    else:
        assert bool(((out - ref32).abs() <= 4e-5 * bound + 1e-30).all())


def moe_case(E, d, inter, s_inter, T, k, gen, device, dup=False):
    w13 = rand_nvfp4((E,), 2 * inter, d, gen, device)
    w2 = rand_nvfp4((E,), d, inter, gen, device)
    shared = None
    if s_inter:
        s13 = rand_nvfp4((), 2 * s_inter, d, gen, device)
        s2 = rand_nvfp4((), d, s_inter, gen, device)
        shared = (*s13, *s2)
    x = rand_x((T, d), gen, device)
    # a few popular experts, so experts repeat across tokens
    pool = torch.randperm(E, generator=gen)[: max(k, min(E, 2 * k))]
    ids = pool[torch.argsort(torch.rand(T, len(pool), generator=gen), dim=1)[:, :k]]
    if dup and k > 1:
        ids[0, 1] = ids[0, 0]
    wts = torch.rand(T, k, generator=gen) * 2
    ids, wts = ids.to(device), wts.to(device)
    return x, ids, wts, w13, w2, shared


def kernel_moe_args(w13, w2, shared):
    """Canonical MoE weights -> the op's kernel-layout arguments (per expert, to bound the memory), on the weights'
    device. Repacked on the host: per expert on the GPU, 256 experts are ~10^4 small launches per call, which
    kept the E = 256 tests from finishing under compute-sanitizer."""
    dev = w13[0].device

    def rep13(p, s):
        p, s = nv.repack_weight(nv.interleave_gate_up(p.cpu()), nv.interleave_gate_up(s.cpu()))
        return p.to(dev), s.to(dev)

    def rep2(p, s):
        p, s = nv.repack_weight(p.cpu(), s.cpu())
        return p.to(dev), s.to(dev)

    def stack(fn, p, s):
        parts = [fn(p[e], s[e]) for e in range(p.shape[0])]
        return torch.stack([a for a, _ in parts]), torch.stack([b for _, b in parts])

    a13 = (*stack(rep13, w13[0], w13[1]), w13[2])
    a2 = (*stack(rep2, w2[0], w2[1]), w2[2])
    sh = (None,) * 6
    if shared is not None:
        sp13, ss13, sg13, sp2, ss2, sg2 = shared
        sh = (*rep13(sp13, ss13), sg13, *rep2(sp2, ss2), sg2)
    return (*a13, *a2, *sh)


def assert_moe_close(out, expect, what, rms_tol=2**-6):
    """bf16 intermediates (gate/up, h, expert outputs) may round differently after an fp32 reordering."""
    assert out.shape == expect.shape and out.dtype == torch.bfloat16
    o, e = out.float(), expect.float()
    rms = e.pow(2).mean().sqrt().clamp_min(1e-30)
    err = (o - e).abs()
    assert bool((err <= 2**-6 * e.abs() + rms_tol * rms).all()), f"{what}: max err {float(err.max()):.3g}, rms {float(rms):.3g}"
    assert float(err.mean()) <= 2**-9 * float(rms), f"{what}: mean err {float(err.mean()):.3g}"


@pytest.mark.parametrize("T", [1, 5, 64])
@pytest.mark.parametrize("with_shared", [False, True])
def test_moe_cpu(T, with_shared):
    gen = torch.Generator().manual_seed(100 + T)
    x, ids, wts, w13, w2, shared = moe_case(8, 272, 80, 48 if with_shared else 0, T, 3, gen, "cpu", dup=True)
    out = ops.nvfp4_moe(x, ids, wts, *kernel_moe_args(w13, w2, shared), 10.0)
    expect = ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, shared, 10.0)
    assert_moe_close(out, expect, f"cpu moe T={T}")
    out32 = ops.nvfp4_moe(x, ids.int(), wts, *kernel_moe_args(w13, w2, shared), 10.0)
    assert torch.equal(out32, out)


def test_cpu_rows_do_not_depend_on_the_other_rows():
    """Each row of a CPU call equals that row called alone, bit for bit (dsv4_ops/csrc/row_matmul.h): what makes a
    speculative verification of T tokens the one-token decode exactly. ATen's matmul does not promise it (on an
    AMD EPYC an MoE expert's 1-token product rounded differently from its 2-token one)."""
    gen = torch.Generator().manual_seed(31)
    x, w, _, _ = linear_case(96, 1024, 7, gen, "cpu")
    whole = ops.nvfp4_linear(x, *w)
    xq, wq, _, _ = w4a4_case(48, 272, (5,), gen, "cpu")
    whole4 = ops.nvfp4_linear_w4a4(*xq, *wq, torch.float32)
    T, E = 6, 8
    xm, ids, wts, w13, w2, shared = moe_case(E, 272, 80, 48, T, 3, gen, "cpu")
    ids[1] = ids[0]  # tokens sharing experts: an expert sees several rows at once
    args = kernel_moe_args(w13, w2, shared)
    moe = ops.nvfp4_moe(xm, ids, wts, *args, 10.0)
    wf = [torch.randn(300, 1024, generator=gen), torch.randn(40, 1024, generator=gen).to(torch.bfloat16)]
    lin32 = ops.fp32_linear(x, wf)
    for r in range(x.shape[0]):
        assert torch.equal(ops.nvfp4_linear(x[r:r + 1], *w)[0], whole[r]), f"nvfp4_linear row {r}"
        assert all(torch.equal(ops.fp32_linear(x[r:r + 1], wf)[i][0], lin32[i][r]) for i in range(2)), r
    for r in range(5):
        one = [t[r:r + 1] for t in xq[:2]] + [xq[2]]
        assert torch.equal(ops.nvfp4_linear_w4a4(*one, *wq, torch.float32)[0], whole4[r]), f"w4a4 row {r}"
    for t in range(T):
        got = ops.nvfp4_moe(xm[t:t + 1], ids[t:t + 1], wts[t:t + 1], *args, 10.0)[0]
        assert torch.equal(got, moe[t]), f"moe token {t}"


def test_moe_cpu_invalid_ids_and_no_clamp():
    gen = torch.Generator().manual_seed(5)
    x, ids, wts, w13, w2, _ = moe_case(4, 128, 16, 0, 6, 2, gen, "cpu")
    ids[1, 0] = -1
    ids[2, 1] = 4
    for limit in (10.0, 0.0):
        out = ops.nvfp4_moe(x, ids, wts, *kernel_moe_args(w13, w2, None), limit)
        assert_moe_close(out, ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, None, limit), f"cpu moe limit={limit}")


def local_rows(ids, n_experts, has_shared):
    """The rows of nvfp4_moe_rows' output that the op writes on every device (bool [T*k + T*has_shared])."""
    local = ((ids >= 0) & (ids < n_experts)).reshape(-1)
    return torch.cat([local, local.new_ones(ids.shape[0] if has_shared else 0)])


@pytest.mark.parametrize("T", [1, 2, 5, 64, 300])
@pytest.mark.parametrize("with_shared", [False, True])
def test_moe_rows_cpu(T, with_shared):
    """nvfp4_moe_rows == the reference's rows bit for bit (zeros for non-local ids), and summing them as the combine
    kernel does (moe_combine_rows_ref, skipping non-local slots whatever their rows hold) gives nvfp4_moe bit for
    bit."""
    gen = torch.Generator().manual_seed(700 + T)
    E, d, k = 8, 272, 3
    x, ids, wts, w13, w2, shared = moe_case(E, d, 80, 48 if with_shared else 0, T, k, gen, "cpu", dup=True)
    ids[T - 1, 0] = -1  # not local experts (expert parallelism)
    ids[T // 2, k - 1] = E
    args = kernel_moe_args(w13, w2, shared)
    rows = ops.nvfp4_moe_rows(x, ids, wts, *args, 10.0)
    assert rows.shape == (T * k + (T if with_shared else 0), d) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, ref.nvfp4_moe_rows_ref(x, ids, wts, *w13, *w2, shared, 10.0))
    keep = local_rows(ids, E, with_shared)
    assert not bool(rows[~keep].any()) and bool(rows[keep].any())
    assert torch.equal(ops.nvfp4_moe_rows(x, ids.int(), wts, *args, 10.0), rows)
    y = ops.nvfp4_moe(x, ids, wts, *args, 10.0)
    assert_moe_close(y, ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, shared, 10.0), f"cpu moe T={T}")
    poisoned = rows.masked_fill(~keep[:, None], float("nan"))  # what CUDA leaves there is unspecified
    assert torch.equal(ref.moe_combine_rows_ref(poisoned, ids, E, with_shared), y)
    assert torch.equal(ref.moe_combine_rows_ref(rows, ids.int(), E, with_shared), y)
    with pytest.raises(RuntimeError, match="nvfp4_moe_rows: topk_weights"):
        ops.nvfp4_moe_rows(x, ids, wts[:, :1].contiguous(), *args, 10.0)


@pytest.mark.parametrize("g,n,k,lead", [(8, 64, 272, (3,)), (3, 40, 144, (2, 1)), (2, 16, 16, ())])
def test_linear_grouped_cpu(g, n, k, lead):
    """Each group's output is its own matrix applied to its own slice of x (and equals the grouped reference)."""
    gen = torch.Generator().manual_seed(g * n + k)
    x, w, canon, ref32, bound = grouped_case(g, n, k, lead, gen, "cpu")
    out = ops.nvfp4_linear_grouped(x, *w)
    assert_bf16_close(out, ref32, bound, f"cpu grouped {g}x{n}x{k}")
    assert torch.equal(ref.nvfp4_linear_grouped_ref(x, *canon), ops.nvfp4_linear_grouped(x, *w))
    for i in range(g):  # a group mix-up (weights, scales, x slice) would not match the per-group linear
        assert torch.equal(out[..., i, :], ops.nvfp4_linear(x[..., i, :].contiguous(), w[0][i], w[1][i], w[2][i]))


def multi_case(ns, k, lead, gen, device):
    """One x [*lead, K], matrices of widths ns (kernel layout), their fp32 references and error bounds."""
    x = rand_x((*lead, k), gen, device)
    ws, refs, bounds = [], [], []
    for n in ns:
        packed, scale, gs = rand_nvfp4((), n, k, gen, device)
        ws.append((*nv.repack_weight(packed, scale), gs))
        w = ref.nvfp4_gemm_dequant_ref(packed, scale, gs)
        refs.append(x.float() @ w.t())
        bounds.append(x.float().abs() @ w.abs().t())
    return x, [list(t) for t in zip(*ws)], refs, bounds


def test_linear_multi_cpu():
    """Each output is nvfp4_linear of its own matrix (widths differ, as wq_a 1024 / wkv 512 do)."""
    gen = torch.Generator().manual_seed(31)
    x, (wp, ws, wg), refs, bounds = multi_case((64, 32, 48), 272, (2, 3), gen, "cpu")
    outs = ops.nvfp4_linear_multi(x, wp, ws, wg)
    assert len(outs) == 3
    for i, (o, r, b) in enumerate(zip(outs, refs, bounds)):
        assert_bf16_close(o, r, b, f"cpu multi {i}")
        assert torch.equal(o, ops.nvfp4_linear(x, wp[i], ws[i], wg[i]))
    with pytest.raises(RuntimeError, match=r"w_scale\[1\]"):
        ops.nvfp4_linear_multi(x, wp, [ws[0], ws[2], ws[1]], wg)
    with pytest.raises(RuntimeError, match="lists of one length"):
        ops.nvfp4_linear_multi(x, wp, ws[:2], wg)


def fp32_weights(ns, k, gen, device, dtypes=(torch.bfloat16,)):
    """Float matrices [n, k] for nvfp4_fp32_linear_multi's fp32 projections, dtypes cycled over them."""
    return [(torch.randn(n, k, generator=gen) / k**0.5).to(dtypes[i % len(dtypes)]).to(device)
            for i, n in enumerate(ns)]


def test_nvfp4_fp32_linear_multi_cpu():
    """The NVFP4 outputs of nvfp4_linear_multi, then the fp32 ones of fp32_linear, bit for bit; every argument
    checked (and named) before any output is computed."""
    gen = torch.Generator().manual_seed(41)
    x, (wp, ws, wg), _, _ = multi_case((64, 32), 272, (2, 3), gen, "cpu")
    fw = fp32_weights((48, 16, 8), 272, gen, "cpu", (torch.bfloat16, torch.float32))
    outs = ops.nvfp4_fp32_linear_multi(x, wp, ws, wg, fw)
    expect = list(ops.nvfp4_linear_multi(x, wp, ws, wg)) + list(ops.fp32_linear(x, fw))
    assert len(outs) == 5
    for i, (o, e) in enumerate(zip(outs, expect)):
        assert o.dtype == e.dtype and torch.equal(o, e), f"output {i}"
    assert [o.dtype for o in outs] == [torch.bfloat16] * 2 + [torch.float32] * 3
    with pytest.raises(RuntimeError, match=r"dsv4::nvfp4_fp32_linear_multi: fp32_weight\[1\] must be \[N, K = 272\]"):
        ops.nvfp4_fp32_linear_multi(x, wp, ws, wg, [fw[0], fw[1][:, :16]])
    with pytest.raises(RuntimeError, match="dsv4::nvfp4_fp32_linear_multi: fp32_weight must list 1 to 8"):
        ops.nvfp4_fp32_linear_multi(x, wp, ws, wg, [])
    with pytest.raises(RuntimeError, match=r"dsv4::nvfp4_fp32_linear_multi: w_scale\[0\]"):
        ops.nvfp4_fp32_linear_multi(x, wp, [ws[1], ws[0]], wg, fw)


def test_linear_grouped_bad_args_name_the_argument():
    gen = torch.Generator().manual_seed(3)
    x, (wk, sk, gs), _, _, _ = grouped_case(4, 32, 144, (2,), gen, "cpu")
    with pytest.raises(RuntimeError, match="w_global_scale"):
        ops.nvfp4_linear_grouped(x, wk, sk, gs[:3])
    with pytest.raises(RuntimeError, match="w_packed"):
        ops.nvfp4_linear_grouped(x[..., :3, :], wk, sk, gs[:3])
    with pytest.raises(RuntimeError, match="x must be bf16"):
        ops.nvfp4_linear_grouped(x.float(), wk, sk, gs)


# ------------------------------------------------------------------------------------------- opcheck (CPU)
def opcheck_args(device, gen):
    x, w, _, _ = linear_case(32, 272, 3, gen, device)
    xq, w4, _, _ = w4a4_case(32, 272, (3,), gen, device)
    mx, ids, wts, w13, w2, shared = moe_case(4, 144, 32, 16, 5, 2, gen, device)
    gx, gw, _, _, _ = grouped_case(4, 32, 272, (3,), gen, device)
    mxx, mw, _, _ = multi_case((32, 16), 272, (3,), gen, device)
    fw = fp32_weights((24, 8), 272, gen, device, (torch.bfloat16, torch.float32))
    return [
        (ops.nvfp4_linear_multi.default, (mxx, *mw)),
        (ops.nvfp4_fp32_linear_multi.default, (mxx, *mw, fw)),
        (ops.nvfp4_linear.default, (x, *w)),
        (ops.nvfp4_linear.default, (x[0], *w)),
        (ops.nvfp4_linear.default, (x, *w, torch.float32)),
        (ops.nvfp4_linear_grouped.default, (gx, *gw)),
        # test_schema compares inputs with allclose, which float8 lacks: the uint8 view of the scales runs all four
        (ops.nvfp4_linear_w4a4.default, (xq[0], xq[1].view(torch.uint8), xq[2], *w4, torch.bfloat16)),
        (ops.nvfp4_moe.default, (mx, ids, wts, *kernel_moe_args(w13, w2, shared), 10.0)),
        (ops.nvfp4_moe.default, (mx, ids.int(), wts, *kernel_moe_args(w13, w2, None), 10.0)),
        # local ids only: on CUDA the rows of other ids are not written, so two calls need not agree there
        (ops.nvfp4_moe_rows.default, (mx, ids, wts, *kernel_moe_args(w13, w2, shared), 10.0)),
        (ops.nvfp4_moe_rows.default, (mx, ids.int(), wts, *kernel_moe_args(w13, w2, None), 10.0)),
    ]


def opcheck_all(device):
    gen = torch.Generator().manual_seed(0)
    for op, args in opcheck_args(device, gen):
        torch.library.opcheck(op, args)
    xq, w4, _, _ = w4a4_case(32, 272, (2, 3), gen, device)
    torch.library.opcheck(ops.nvfp4_linear_w4a4.default, (*xq, *w4, torch.float32),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_opcheck_cpu():
    opcheck_all("cpu")


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(0)
    cases = opcheck_args("cpu", gen)
    mode = FakeTensorMode()
    def to_fake(a):
        if isinstance(a, torch.Tensor):
            return mode.from_tensor(a)
        return [to_fake(t) for t in a] if isinstance(a, list) else a

    for op, args in cases:
        real = op(*args)
        with mode:
            fake = op(*[to_fake(a) for a in args])
        for f, r in zip(*((fake, real) if isinstance(real, list) else ([fake], [real]))):
            assert f.shape == r.shape and f.dtype == r.dtype and f.stride() == r.stride()


# ------------------------------------------------------------------------------------------- modules (CPU)
def test_quantize_weight_matches_reference_quantizer():
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(48, 256, generator=gen) * 0.05).to(torch.bfloat16)
    packed, scale, gs = nv.quantize_weight(w)
    assert packed.shape == (48, 128) and scale.dtype == torch.float8_e4m3fn and gs.shape == ()
    assert torch.equal(gs, w.float().abs().amax() / 2688.0)
    rp, rs = ref.nvfp4_quantize_ref(w, gs)
    assert torch.equal(packed, rp) and torch.equal(scale.view(torch.uint8), rs.view(torch.uint8))
    deq = ref.nvfp4_gemm_dequant_ref(packed, scale, gs)
    # round trip: every element within half an E2M1 step of its block (<= 1/6 of the block max, plus the
    # E4M3 rounding of the block scale)
    blk_max = w.float().abs().unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
    err = (deq - w.float()).abs().unflatten(-1, (-1, 16))
    assert bool((err <= blk_max * (1 / 6 + 1 / 16) + 1e-9).all())
    # stacked experts: one global scale per matrix
    ws = torch.stack([w, 2 * w])
    p2, s2, g2 = nv.quantize_weight(ws)
    assert g2.shape == (2,) and torch.equal(p2[0], packed) and torch.equal(p2[1], packed)


def test_nvfp4_linear_module_vs_bf16():
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(96, 256, generator=gen) * 0.05).to(torch.bfloat16)
    x = rand_x((5, 256), gen)
    mod = nvfp4_linear(w)
    y = mod(x)
    y_bf16 = torch.nn.functional.linear(x, w).float()
    rel = ((y.float() - y_bf16).pow(2).mean() / y_bf16.pow(2).mean()).sqrt()
    assert float(rel) < 0.15, f"NVFP4 vs bf16 relative rms error {float(rel):.3f}"
    wd = dequantized_weight(mod)
    assert_bf16_close(y, x.float() @ wd.t(), x.float().abs() @ wd.abs().t(), "module vs its dequantized weight")
    mod4 = nvfp4_linear(w, act_quant="nvfp4")
    y4 = mod4(x)
    rel4 = ((y4.float() - y_bf16).pow(2).mean() / y_bf16.pow(2).mean()).sqrt()
    assert float(rel4) < 0.25, f"W4A4 vs bf16 relative rms error {float(rel4):.3f}"
    # W4A4 quantizes each row with its own global scale; the reference dequantizes both operands exactly
    xq = ops.fused_amax_quantize_per_row(x)
    wq = nv.unrepack_weight(mod4.weight_packed, mod4.weight_scale, 256)
    expect = ref.nvfp4_linear_w4a4_ref(*xq, *wq, mod4.weight_global_scale)
    torch.testing.assert_close(y4, expect, atol=1e-5, rtol=2**-7)


def test_nvfp4_moe_module_vs_bf16():
    from dsv4_model.model.moe import Expert, Experts

    gen = torch.Generator().manual_seed(6)
    E, d, inter, T, k = 6, 128, 64, 7, 2
    experts = Experts(E, d, inter, 10.0, torch.bfloat16)
    shared = Expert(d, inter, torch.bfloat16, 10.0)
    for p in list(experts.parameters()) + list(shared.parameters()):
        p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    x = rand_x((T, d), gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=gen)
    y_bf16 = (experts.forward_loop(x, wts, ids) + shared(x).float()).to(torch.bfloat16).float()
    mod = Nvfp4MoE.from_float(experts.w1, experts.w2, experts.w3,
                              (shared.w1.weight, shared.w2.weight, shared.w3.weight), 10.0)
    y = mod(x, ids, wts).float()
    rel = ((y - y_bf16).pow(2).mean() / y_bf16.pow(2).mean()).sqrt()
    assert float(rel) < 0.2, f"NVFP4 MoE vs bf16 relative rms error {float(rel):.3f}"


# ------------------------------------------------------------------------------------------- CUDA
V4_FLASH = [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (4096, 4096), (4096, 2048), (2048, 4096)]
V4_PRO = [(1536, 7168), (65536, 1536), (7168, 16384), (6144, 7168), (7168, 3072)]
ODD = [(40, 272), (24, 144), (8, 16)]


def _linear_cuda_sweep(n, k):
    gen = torch.Generator().manual_seed(n + k)
    packed, scale, gs = rand_nvfp4((), n, k, gen, "cuda")
    wk, sk = nv.repack_weight(packed, scale)
    w = ref.nvfp4_gemm_dequant_ref(packed, scale, gs)
    ms = [1, 3, 8, 64, 513] if (n, k) not in V4_PRO else [1, 8, 513]
    if (n, k) in ODD or (n, k) == (4096, 2048):
        ms += [12, 20, 40, 65, 130]  # every token-tile width of the skinny kernel, and the tiled kernel's edges
    for m in ms:
        x = rand_x((m, k), gen, "cuda")
        ref32 = x.float() @ w.t()
        bound = x.float().abs() @ w.abs().t()
        assert_bf16_close(ops.nvfp4_linear(x, wk, sk, gs), ref32, bound, f"cuda linear {m}x{n}x{k}")


# The full-size sweeps are `slow` and not `kernels`: compute-sanitizer runs the `kernels` tests below, which
# reach every kernel path (all token-tile widths, K and N tails, tiled / cuBLAS, MoE) at smaller sizes.
@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("n,k", V4_FLASH + V4_PRO)
def test_linear_cuda_v4_shapes(n, k):
    _linear_cuda_sweep(n, k)


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("n,k", ODD + [(4096, 2048)])
def test_linear_cuda(n, k):
    _linear_cuda_sweep(n, k)


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("choice", ["tiled", "cublas", "wgmma", "wgmma_wide"])
@pytest.mark.parametrize("n,k", [(1024, 4096), (40, 272), (24, 144)])
def test_linear_cuda_forced_kernels(choice, n, k):
    """Each M > 64 kernel path forced by the nvfp4_gemm_kernel override (tiled / cublas / wgmma / wgmma_wide)
    stays correct."""
    gen = torch.Generator().manual_seed(9)
    for m in (65, 130, 513, 1000):
        x, w, ref32, bound = linear_case(n, k, m, gen, "cuda")
        if choice == "cublas":
            # The op's bf16 weight buffer most likely reuses the block freed here (the caching allocator): a value
            # the dequantize failed to write stays NaN instead of an earlier call's right one.
            torch.full((n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        with kernel_choice(choice):
            out = ops.nvfp4_linear(x, *w)
        assert_bf16_close(out, ref32, bound, f"cuda {choice} linear {m}x{n}x{k}")


# K split over a cluster where the tiles alone leave SMs idle: (520, 1296) N and K tails, 4 splits of 3 chunks
# (the last one short); (1030, 1024) N % 4 != 0 (scalar stores); (4096, 4096) 8 splits.
@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("n,k", [(520, 1296), (1030, 1024), (4096, 4096)])
def test_linear_cuda_tiled_small_m(n, k):
    """8 < M <= 64 (one dense matrix): the tiled kernel with 32- / 64-token tiles and the cluster K split, W4A16
    and W4A4 (fp32 out), deterministic, and within the same bound as the skinny kernel it replaced there."""
    gen = torch.Generator().manual_seed(n + k)
    for m in (9, 16, 33, 64, 100):
        x, w, ref32, bound = linear_case(n, k, m, gen, "cuda")
        out = ops.nvfp4_linear(x, *w)
        assert_bf16_close(out, ref32, bound, f"cuda tiled linear {m}x{n}x{k}")
        assert torch.equal(ops.nvfp4_linear(x, *w), out), f"tiled linear {m}x{n}x{k} not deterministic"
        with kernel_choice("skinny"):
            assert_bf16_close(ops.nvfp4_linear(x, *w), ref32, bound, f"cuda skinny linear {m}x{n}x{k}")
    for m in (12, 64):
        xq, w, ref32, bound = w4a4_case(n, k, (m,), gen, "cuda")
        out32 = ops.nvfp4_linear_w4a4(*xq, *w, torch.float32)
        assert bool(((out32 - ref32).abs() <= 4e-5 * bound + 1e-30).all()), f"cuda tiled w4a4 {m}x{n}x{k}"


# The wgmma kernel (nvfp4_wgmma.cu) at every token tile (16 / 32 / 64 / 128, several tiles past 128), with the
# cluster K split, N and K tails, N % 4 != 0, W4A16 and W4A4 (fp32 out): within the bound of the reference,
# deterministic; the same for its wide tile (256 rows: two wgmma blocks per warpgroup, N tails inside a block and
# a whole empty second block at N = 24 / 130).
@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("choice", ["wgmma", "wgmma_wide"])
@pytest.mark.parametrize("n,k", [(520, 1296), (1030, 1024), (4096, 4096), (24, 144), (4096, 8192), (130, 512)])
def test_linear_cuda_wgmma(choice, n, k):
    gen = torch.Generator().manual_seed(3 * n + k)
    for m in (9, 16, 33, 64, 100, 128, 200, 513):
        x, w, ref32, bound = linear_case(n, k, m, gen, "cuda")
        with kernel_choice(choice):
            out = ops.nvfp4_linear(x, *w)
            again = ops.nvfp4_linear(x, *w)
        assert_bf16_close(out, ref32, bound, f"cuda {choice} linear {m}x{n}x{k}")
        assert torch.equal(again, out), f"{choice} linear {m}x{n}x{k} not deterministic"
    for m in (12, 64, 130):
        xq, w, ref32, bound = w4a4_case(n, k, (m,), gen, "cuda")
        with kernel_choice(choice):
            out32 = ops.nvfp4_linear_w4a4(*xq, *w, torch.float32)
        assert bool(((out32 - ref32).abs() <= 4e-5 * bound + 1e-30).all()), f"cuda {choice} w4a4 {m}x{n}x{k}"


# (1024, 4096): 8 warps split K; (32768, 1024): more CTAs than fit at once; the small ones: N / K tails, CTAs
# with no valid row tile, K shorter than the ring.
@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("n,k", [(1024, 4096), (32768, 1024), (4096, 2048), (40, 272), (24, 144), (8, 16)])
def test_linear_cuda_decode_kernels(n, k):
    """M <= 8: the gemv kernel (default; 2- and 8-row passes, with and without programmatic dependent launch) and
    the skinny kernel (nvfp4_gemm_kernel="skinny"), W4A16 and W4A4."""
    gen = torch.Generator().manual_seed(n + 3 * k)
    for m in (1, 2, 3, 8):
        x, w, ref32, bound = linear_case(n, k, m, gen, "cuda")
        with kernel_choice("skinny"):
            assert_bf16_close(ops.nvfp4_linear(x, *w), ref32, bound, f"cuda skinny linear {m}x{n}x{k}")
        out = ops.nvfp4_linear(x, *w)
        with kernel_overrides(pdl=False):
            assert torch.equal(ops.nvfp4_linear(x, *w), out), f"gemv without PDL {m}x{n}x{k}"
        with kernel_overrides(gemv_pdl_rows=3 if m < 8 else 9):  # the default's other side of the row rule
            assert torch.equal(ops.nvfp4_linear(x, *w), out), f"gemv, the other PDL rule {m}x{n}x{k}"
        assert_bf16_close(out, ref32, bound, f"cuda gemv linear {m}x{n}x{k}")
    for m in (1, 8):
        xq, w, ref32, bound = w4a4_case(n, k, (m,), gen, "cuda")
        for choice in ("auto", "skinny"):
            with kernel_choice(choice):
                out32 = ops.nvfp4_linear_w4a4(*xq, *w, torch.float32)
            assert bool(((out32 - ref32).abs() <= 4e-5 * bound + 1e-30).all()), f"cuda {choice} w4a4 {m}x{n}x{k}"


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_linear_w4a4_cuda(m):
    gen = torch.Generator().manual_seed(20 + m)
    for n, k in [(4096, 4096), (40, 272)]:
        xq, w, ref32, bound = w4a4_case(n, k, (m,), gen, "cuda")
        assert_bf16_close(ops.nvfp4_linear_w4a4(*xq, *w, torch.bfloat16), ref32, bound, f"cuda w4a4 {m}x{n}x{k}")
        out32 = ops.nvfp4_linear_w4a4(*xq, *w, torch.float32)
        assert bool(((out32 - ref32).abs() <= 4e-5 * bound + 1e-30).all())


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("g,n,k", [(8, 1024, 4096), (3, 40, 272), (2, 24, 144)])
def test_linear_grouped_cuda(g, n, k):
    """All groups in one launch (gemv: M <= 8; skinny: M < 32, or to 64 forced; wgmma: 32 <= M <= 1024, or every
    M > 8 forced), with PDL on and off; each group through the nvfp4_linear paths beyond 1024 rows; V4-Flash wo_a
    is 8 x (1024 x 4096)."""
    gen = torch.Generator().manual_seed(g + n + k)
    for m in (1, 2, 5, 8, 20, 33, 64, 100, 1100):
        x, w, _, ref32, bound = grouped_case(g, n, k, (m,), gen, "cuda")
        out = ops.nvfp4_linear_grouped(x, *w)
        assert_bf16_close(out, ref32, bound, f"cuda grouped {m}x{g}x{n}x{k}")
        with kernel_overrides(pdl=False):
            assert torch.equal(ops.nvfp4_linear_grouped(x, *w), out), f"grouped without PDL {m}"
        if m <= 64:
            with kernel_choice("skinny"):
                assert_bf16_close(ops.nvfp4_linear_grouped(x, *w), ref32, bound, f"cuda skinny grouped {m}")
        if m > 8:
            with kernel_choice("wgmma"):
                again = ops.nvfp4_linear_grouped(x, *w)
                assert_bf16_close(again, ref32, bound, f"cuda wgmma grouped {m}")
                assert torch.equal(ops.nvfp4_linear_grouped(x, *w), again), f"wgmma grouped {m} not deterministic"
        xs = x[::2] if m > 1 else x  # a strided batch view
        assert_bf16_close(ops.nvfp4_linear_grouped(xs, *w), ref32[::2] if m > 1 else ref32, bound[::2] if m > 1
                          else bound, f"cuda grouped strided {m}")


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("ns,k", [((1024, 512), 4096), ((40, 8, 24, 16), 272), ((16, 32, 8, 8, 24), 144)])
def test_linear_multi_cuda(ns, k):
    """V4-Flash wq_a + wkv (1024 / 512 x 4096) in one launch at decode sizes (gemv; skinny forced; PDL on and off);
    segments narrower than others; five matrices (more than one launch holds); from M = 9 each matrix as its own
    nvfp4_linear (the same bits)."""
    gen = torch.Generator().manual_seed(len(ns) + k)
    for m in (1, 3, 8, 20, 40, 100):
        x, w, refs, bounds = multi_case(ns, k, (m,), gen, "cuda")
        outs = ops.nvfp4_linear_multi(x, *w)
        for i, (o, r, b) in enumerate(zip(outs, refs, bounds)):
            assert_bf16_close(o, r, b, f"cuda multi {m} seg {i}")
        with kernel_overrides(pdl=False):
            assert all(torch.equal(a, b) for a, b in zip(ops.nvfp4_linear_multi(x, *w), outs))
        if m > 8:
            for i, o in enumerate(outs):
                assert torch.equal(o, ops.nvfp4_linear(x, w[0][i], w[1][i], w[2][i])), f"multi {m} seg {i}"
        if m <= 64:
            with kernel_choice("skinny"):
                for i, (o, r, b) in enumerate(zip(ops.nvfp4_linear_multi(x, *w), refs, bounds)):
                    assert_bf16_close(o, r, b, f"cuda skinny multi {m} seg {i}")


def assert_same(outs, expect, what):
    assert len(outs) == len(expect), f"{what}: {len(outs)} outputs, expected {len(expect)}"
    for i, (a, b) in enumerate(zip(outs, expect)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: output {i}"


@pytest.mark.cuda
@pytest.mark.kernels
def test_nvfp4_fp32_linear_multi_cuda():
    """V4-Flash's attention decode projections of x (wq_a + wkv NVFP4; the compressors' wkv / wgate and the
    indexer's weights_proj in fp32 math) in one call: the bits of the two ops at every M, with the fp32 kernel
    beside the gemv or after it, PDL on or off (for the gemv alone too), skinny forced, five NVFP4 matrices (one
    launch each), weights of both float dtypes (two fp32 launches), x a strided view (copied first)."""
    gen = torch.Generator().manual_seed(43)
    big = (1024, 1024, 256, 256, 64)
    overs = ({}, {"beside": True}, {"beside": True, "pdl": False}, {"beside": True, "gemv_pdl": False},
             {"beside": True, "gemv_pdl_rows": 2},
             {"nvfp4_gemm_kernel": "skinny"})
    for m in (1, 2, 3, 8, 12):
        x, w, _, _ = multi_case((1024, 512), 4096, (m,), gen, "cuda")
        for dtypes in ((torch.bfloat16,), (torch.bfloat16, torch.float32)):
            fw = fp32_weights(big, 4096, gen, "cuda", dtypes)
            for over in overs:  # the two ops under the same override (skinny's bits are its own)
                with kernel_overrides(**over):
                    expect = list(ops.nvfp4_linear_multi(x, *w)) + list(ops.fp32_linear(x, fw))
                    assert_same(ops.nvfp4_fp32_linear_multi(x, *w, fw), expect, f"M = {m} {dtypes} {over}")
    x, w, _, _ = multi_case((64, 32, 48, 16, 80), 272, (2,), gen, "cuda")
    fw = fp32_weights((24, 8), 272, gen, "cuda")
    assert_same(ops.nvfp4_fp32_linear_multi(x, *w, fw),
                list(ops.nvfp4_linear_multi(x, *w)) + list(ops.fp32_linear(x, fw)), "five matrices")
    wide = rand_x((1, 8192), gen, "cuda")
    xs = wide[:, ::2]  # not contiguous: both ops copy it
    x, w, _, _ = multi_case((1024, 512), 4096, (1,), gen, "cuda")
    fw = fp32_weights(big, 4096, gen, "cuda")
    assert_same(ops.nvfp4_fp32_linear_multi(xs, *w, fw),
                list(ops.nvfp4_linear_multi(xs.contiguous(), *w)) + list(ops.fp32_linear(xs.contiguous(), fw)),
                "strided x")


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("m", [1, 8])
def test_nvfp4_fp32_linear_multi_cuda_graph_order(m):
    """Beside the gemv, the fp32 kernel must neither read x early nor let what follows the op start before the
    gemv is done. A CUDA graph: x from an NVFP4 linear just before the op, then linears (PDL) reading the gemv's
    outputs at once; the fp32 projection is one tiny matrix, far shorter than the gemv. Every static output is
    NaN before each replay, so a read before its write shows; 30 replays against the two ops run eagerly."""
    gen = torch.Generator().manual_seed(44)
    _, w, _, _ = multi_case((1024, 512), 4096, (m,), gen, "cuda")
    p0 = rand_nvfp4((), 4096, 4096, gen, "cuda")
    w0 = (*nv.repack_weight(p0[0], p0[1]), p0[2])
    pa = rand_nvfp4((), 2048, 1024, gen, "cuda")
    wa = (*nv.repack_weight(pa[0], pa[1]), pa[2])
    pb = rand_nvfp4((), 2048, 512, gen, "cuda")
    wb = (*nv.repack_weight(pb[0], pb[1]), pb[2])
    tiny = fp32_weights((8,), 4096, gen, "cuda")
    x0 = rand_x((m, 4096), gen, "cuda")

    def step(fused):
        xx = ops.nvfp4_linear(x0, *w0)
        if fused:
            outs = ops.nvfp4_fp32_linear_multi(xx, *w, tiny)
        else:
            outs = list(ops.nvfp4_linear_multi(xx, *w)) + list(ops.fp32_linear(xx, tiny))
        return [*outs, ops.nvfp4_linear(outs[0], *wa), ops.nvfp4_linear(outs[1], *wb)]

    torch.cuda.synchronize()
    with kernel_overrides(beside=True):  # the launch choices are read at capture
        step(True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static = step(True)
    for _ in range(30):
        x0.copy_(rand_x((m, 4096), gen, "cuda"))
        for t in static:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_same(static, step(False), "graph replay")


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 5, 64])
def test_moe_cuda_v4_flash(T):
    gen = torch.Generator().manual_seed(200 + T)
    x, ids, wts, w13, w2, shared = moe_case(32, 4096, 2048, 2048, T, 6, gen, "cuda")
    args = kernel_moe_args(w13, w2, shared)
    out = ops.nvfp4_moe(x, ids, wts, *args, 10.0)
    assert_moe_close(out, ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, shared, 10.0), f"cuda moe T={T}")
    with kernel_overrides(pdl=False):  # the same kernels without programmatic dependent launch
        assert torch.equal(ops.nvfp4_moe(x, ids, wts, *args, 10.0), out)
    with kernel_choice("skinny"):
        out = ops.nvfp4_moe(x, ids, wts, *args, 10.0)
    assert_moe_close(out, ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, shared, 10.0), f"cuda skinny moe T={T}")


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("T", [1, 2, 5, 64, 300])
def test_moe_cuda_many_experts_padded(T):
    gen = torch.Generator().manual_seed(300 + T)
    x, ids, wts, w13, w2, shared = moe_case(256, 272, 80, 48, T, 6, gen, "cuda", dup=True)
    if T > 1:
        ids[T // 2] = ids[0]  # two tokens with the same experts
    for sh in (shared, None):
        args = kernel_moe_args(w13, w2, sh)
        out = ops.nvfp4_moe(x, ids, wts, *args, 10.0)
        assert_moe_close(out, ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, sh, 10.0), f"cuda moe padded T={T}")
    for choice in ("skinny", "wgmma", "wgmma_wide"):
        for sh in (shared, None):
            with kernel_choice(choice):
                out = ops.nvfp4_moe(x, ids, wts, *kernel_moe_args(w13, w2, sh), 10.0)
            assert_moe_close(out, ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, sh, 10.0), f"cuda {choice} moe T={T}")


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("T", [40, 100, 700])
def test_moe_cuda_many_tokens_per_expert(T):
    """Few experts, many tokens each: the wider token tiles and the per-expert token loop (the wgmma kernels' 16- to
    128-token tiles, several per expert at T = 700; 128- and 256-row tiles)."""
    gen = torch.Generator().manual_seed(400 + T)
    x, ids, wts, w13, w2, shared = moe_case(8, 272, 80, 48, T, 2, gen, "cuda")
    args = kernel_moe_args(w13, w2, shared)
    expect = ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, shared, 10.0)
    for choice in ("auto", "wgmma", "wgmma_wide"):
        with kernel_choice(choice):
            out = ops.nvfp4_moe(x, ids, wts, *args, 10.0)
            again = ops.nvfp4_moe(x, ids, wts, *args, 10.0)
        assert_moe_close(out, expect, f"cuda {choice} moe many T={T}")
        assert torch.equal(again, out), f"cuda {choice} moe many T={T} not deterministic"


@pytest.mark.cuda
@pytest.mark.kernels
def test_linear_out_dtype_cuda():
    """gemv (M <= 8), tiled (8 < M < 32), wgmma (32 <= M <= 1024), dequantize + cuBLAS (M > 1024)."""
    check_linear_out_dtypes("cuda", (1, 5, 20, 70, 1100))


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("E,T", [(256, 1), (256, 8), (256, 7), (32, 8), (8, 8), (8, 7)])
def test_moe_cuda_gemv_rows(E, T):
    """The moe_gemv_rows override (the gemv kernel's token rows per pass, 2 or 8) within the reference's tolerance
    either way (not bit for bit: the row count changes the launch plan's K split, so the order of the partial
    sums), with and without the shared expert (2-token slots of it, a partial last one at T = 7), experts with more
    tokens than a pass (several passes, a partial last one: ~4 tokens each), the route kernel (T * k > 32) and
    local routing (E = 8)."""
    gen = torch.Generator().manual_seed(600 + E + T)
    x, ids, wts, w13, w2, shared = moe_case(E, 1024, 512, 272, T, 6 if E > 8 else 4, gen, "cuda")
    for sh in (shared, None):
        args = kernel_moe_args(w13, w2, sh)
        want = ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, sh, 10.0)
        for rows in (2, 8):
            with kernel_overrides(moe_gemv_rows=rows):
                assert_moe_close(ops.nvfp4_moe(x, ids, wts, *args, 10.0), want,
                                 f"rows={rows} E={E} T={T} shared={sh is not None}")


@pytest.mark.cuda
@pytest.mark.kernels
def test_moe_cuda_invalid_ids():
    gen = torch.Generator().manual_seed(8)
    x, ids, wts, w13, w2, _ = moe_case(4, 128, 16, 0, 6, 2, gen, "cuda")
    ids[1, 0] = -1
    ids[2, 1] = 4
    out = ops.nvfp4_moe(x, ids, wts, *kernel_moe_args(w13, w2, None), 0.0)
    assert_moe_close(out, ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, None, 0.0), "cuda moe invalid ids")


# E = 256, k = 6: T = 1, 2 (2-row gemv passes, local routing), 5 (local routing), 64 (gemv, route kernel), 300
# (T*k > 4E: skinny); the nvfp4_gemm_kernel override forces skinny at every T.
@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("T", [1, 2, 5, 64, 300])
def test_moe_rows_cuda(T):
    """nvfp4_moe_rows on CUDA: the written rows match the reference's rows (the MoE tolerance: tensor-core sums
    run in another order), and their combine (moe_combine_rows_ref) == nvfp4_moe bit for bit, with and without
    the shared expert, every kernel path, PDL on and off; with non-local ids (-1, E) in the mix only the local
    rows are compared (the others are not written)."""
    gen = torch.Generator().manual_seed(800 + T)
    E, d, k = 256, 272, 6
    x, ids, wts, w13, w2, shared = moe_case(E, d, 80, 48, T, k, gen, "cuda", dup=True)
    if T > 1:
        ids[T // 2] = ids[0]  # two tokens with the same experts
    ext = ids.clone()
    ext[T - 1, 0] = -1
    ext[T // 2, k - 1] = E
    for sh in (shared, None):
        args = kernel_moe_args(w13, w2, sh)
        has = sh is not None
        for topk in (ids, ext):
            expect = ref.nvfp4_moe_rows_ref(x, topk, wts, *w13, *w2, sh, 10.0)
            keep = local_rows(topk, E, has)
            for choice in ("auto", "skinny", "wgmma", "wgmma_wide"):
                what = f"cuda {choice} moe rows T={T} shared={has} all_local={topk is ids}"
                with kernel_choice(choice):
                    rows = ops.nvfp4_moe_rows(x, topk, wts, *args, 10.0)
                    y = ops.nvfp4_moe(x, topk, wts, *args, 10.0)
                    with kernel_overrides(pdl=False):
                        again = ops.nvfp4_moe_rows(x, topk, wts, *args, 10.0)
                assert rows.shape == (T * k + (T if has else 0), d) and rows.dtype == torch.bfloat16, what
                assert torch.equal(again[keep], rows[keep]), what
                # one expert's row, not the sum of k + 1: an h element's rounding flip is not averaged away
                # (H200, T = 300: max err 1 at rms 32)
                assert_moe_close(rows[keep], expect[keep], what, rms_tol=2**-4)
                assert torch.equal(ref.moe_combine_rows_ref(rows, topk, E, has), y), what


# T * k = 6 ... 32 (routes itself), 36 (beyond kLocalRouteMax: the route kernel runs), E = 8 / 16 / 256, k = 6 / 2.
@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("E,T,k", [(256, 1, 6), (256, 2, 6), (16, 3, 6), (256, 5, 6), (256, 6, 6), (8, 16, 2)])
def test_moe_cuda_local_route(E, T, k):
    """Local routing (the default while T * k <= 32; the moe_local_route override turns it off): the up / down
    kernels derive each slot's expert and assignments from the ids (no route kernel) -- bit-equal to the routed path (every assignment's output is computed alone), duplicate
    experts in a token, invalid ids, with and without the shared expert, gemv and skinny, PDL on and off, and a
    CUDA graph replayed on new routing."""
    gen = torch.Generator().manual_seed(500 + E + T)
    x, ids, wts, w13, w2, shared = moe_case(E, 272, 80, 48, T, k, gen, "cuda", dup=True)
    if T > 2:
        ids[T // 2] = ids[0]  # two tokens with the same experts
        ids[1, 0] = -1
        ids[2, k - 1] = E  # out of range: dropped
    for sh in (shared, None):
        args = kernel_moe_args(w13, w2, sh)
        expect = ref.nvfp4_moe_ref(x, ids, wts, *w13, *w2, sh, 10.0)
        for choice in ("auto", "skinny"):
            with kernel_choice(choice):
                with kernel_overrides(moe_local_route=False):
                    want = ops.nvfp4_moe(x, ids, wts, *args, 10.0)  # the route kernel
                with kernel_overrides(moe_local_route=True):
                    got = ops.nvfp4_moe(x, ids, wts, *args, 10.0)
                    rows = ops.nvfp4_moe_rows(x, ids, wts, *args, 10.0)
                    with kernel_overrides(pdl=False):
                        assert torch.equal(ops.nvfp4_moe(x, ids, wts, *args, 10.0), got), f"no PDL {choice}"
            what = f"local route {choice} E={E} T={T} shared={sh is not None}"
            assert torch.equal(got, want), what
            assert torch.equal(ref.moe_combine_rows_ref(rows, ids, E, sh is not None), got), what
            assert_moe_close(got, expect, what)
    args = kernel_moe_args(w13, w2, shared)
    with kernel_overrides(moe_local_route=True):
        ops.nvfp4_moe(x, ids, wts, *args, 10.0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = ops.nvfp4_moe(x, ids, wts, *args, 10.0)
        ids.copy_(torch.randint(-1, E + 1, ids.shape, generator=gen).to("cuda"))
        x.copy_(rand_x(x.shape, gen, "cuda"))
        graph.replay()
    assert torch.equal(static_out, ops.nvfp4_moe(x, ids, wts, *args, 10.0)), "local route graph replay"


@pytest.mark.cuda
@pytest.mark.kernels
def test_opcheck_cuda():
    opcheck_all("cuda")


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_and_no_sync():
    gen = torch.Generator().manual_seed(12)
    packed, scale, gs = rand_nvfp4((), 4096, 4096, gen, "cuda")
    wk, sk = nv.repack_weight(packed, scale)
    xq, w4, _, _ = w4a4_case(512, 1024, (8,), gen, "cuda")
    mx, ids, wts, w13, w2, shared = moe_case(64, 512, 256, 256, 16, 6, gen, "cuda")
    margs = kernel_moe_args(w13, w2, shared)
    xs = {m: rand_x((m, 4096), gen, "cuda") for m in (1, 64, 513)}
    gx, gw, _, _, _ = grouped_case(8, 256, 512, (2,), gen, "cuda")
    mw = multi_case((1024, 512), 4096, (1,), gen, "cuda")[1]

    def run():
        outs = [ops.nvfp4_linear(xs[m], wk, sk, gs) for m in xs]
        outs.append(ops.nvfp4_linear_grouped(gx, *gw))
        outs.extend(ops.nvfp4_linear_multi(xs[1], *mw))
        outs.append(ops.nvfp4_linear_w4a4(*xq, *w4, torch.bfloat16))
        outs.append(ops.nvfp4_moe(mx, ids, wts, *margs, 10.0))
        outs.append(ops.nvfp4_moe_rows(mx, ids, wts, *margs, 10.0))  # local ids: every row written
        return outs

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()  # warm-up (and: no host sync anywhere in the ops)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = run()
    # new inputs, written into the captured buffers
    for m in xs:
        xs[m].copy_(rand_x((m, 4096), gen, "cuda"))
    mx.copy_(rand_x(mx.shape, gen, "cuda"))
    gx.copy_(rand_x(gx.shape, gen, "cuda"))
    ids.copy_(torch.randint(0, 64, ids.shape, generator=gen).to("cuda"))
    wts.copy_(torch.rand(wts.shape, generator=gen).to("cuda"))
    xq[0].copy_(torch.randint(0, 256, xq[0].shape, generator=gen, dtype=torch.uint8).to("cuda"))
    g.replay()
    torch.cuda.synchronize()
    eager = run()
    for i, (a, b) in enumerate(zip(static_out, eager)):
        assert torch.equal(a, b), f"graph replay output {i} differs from eager"
