"""NVFP4 quantization ops: bit-exact CPU/CUDA kernels vs the pure-torch reference (ties, zeros, tiny/huge,
NaN/inf), independent checks of the reference (brute-force RNE encoders, error bound, ModelOpt convention),
opcheck, FakeTensor/meta, torch.compile(fullgraph) and CUDA-graph replay."""
import math

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OPS = torch.ops.dsv4
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ---------------------------------------------------------------------------------------------- helpers

def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_bit_equal(got, want, what=""):
    """Codes, scales and global scales identical (dequantized values: equal incl. NaN positions)."""
    if isinstance(got, torch.Tensor):
        got, want = (got,), (want,)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = g.cpu(), w.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape, (what, i, g.dtype, w.dtype, g.shape, w.shape)
        if g.is_floating_point() and g.dtype != torch.float8_e4m3fn:
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=f"{what} output {i}")
        else:
            bad = (_raw(g) != _raw(w)).nonzero()
            assert bad.numel() == 0, f"{what} output {i}: {bad.shape[0]} mismatches, first at {bad[:4].tolist()}"


def _neighbours(v: torch.Tensor, dtype) -> torch.Tensor:
    """v and its next representable neighbours (down, up) in dtype, as fp32."""
    v = v.to(dtype)
    if dtype == torch.float32:
        lo, hi = torch.nextafter(v, v - 1), torch.nextafter(v, v + 1)
    else:
        bits = v.view(torch.int16)
        lo, hi = (bits - 1).view(dtype), (bits + 1).view(dtype)  # positive v: +-1 ulp
    return torch.cat([v, lo, hi]).float()


def _block(vals, vmax):
    """A 16-block holding vmax and then vals (cycled), fp32."""
    vals = list(vals)
    out = [vmax] + [vals[i % len(vals)] for i in range(15)] if vals else [vmax] + [0.0] * 15
    return torch.tensor(out, dtype=torch.float32)


def tie_tensor(dtype) -> torch.Tensor:
    """Rows of 8 blocks. x[r, amax position] = 2688, so the global scale is exactly 1 and a block with max 6*2^e
    gets block scale 2^e and element scale 2^-e: its values land exactly on the E2M1 ties (and next to them)."""
    base = _neighbours(torch.tensor(TIES), dtype)  # 21 values
    signed = torch.cat([base, -base, torch.tensor([0.0, -0.0, 6.0, -6.0, 7.0])])
    rows = []
    for r in range(4):
        blocks = []
        for b in range(8):
            e = float(2 ** ((b % 5) - 2))  # block scales 1/4 .. 4
            chunk = signed[(b * 7 + r * 3) % signed.numel():][:15]
            if chunk.numel() < 15:
                chunk = torch.cat([chunk, signed[: 15 - chunk.numel()]])
            blocks.append(_block((chunk * e).tolist(), 6.0 * e))
        row = torch.cat(blocks)
        row[(r * 37) % 128] = 2688.0 if r % 2 == 0 else -2688.0  # amax in a different block per row
        rows.append(row)
    x = torch.stack(rows)
    assert torch.equal(x.to(dtype).float(), x), "tie values must be exact in the input dtype"
    return x.to(dtype)


def cases(dtype):
    """(name, x) pairs in dtype, built on CPU, deterministic."""
    g = torch.Generator().manual_seed(1234)
    out = [("ties", tie_tensor(dtype))]
    scales = torch.logspace(-3, 3, 24)[:, None]
    out.append(("random", (torch.randn(24, 96, generator=g) * scales).to(dtype)))
    z = torch.randn(6, 64, generator=g)
    z[1] = 0.0
    z[2] = -0.0
    z[3, :16] = 0.0
    z[3, 16:32] = -0.0
    z[4, ::3] = -0.0
    out.append(("zeros", z.to(dtype)))
    out.append(("all_zero", torch.zeros(3, 32, dtype=dtype)))
    # Block flush and e4m3 subnormal scales: amax 2688 (global scale 1), block maxima 6 * 2^-9 (smallest
    # subnormal scale), 6 * 2^-10 (exact tie -> scale 0), just above it, and far below.
    t = torch.zeros(2, 96)
    t[:, 0] = 2688.0
    for b, vmax in enumerate([6 * 2.0**-9, 6 * 2.0**-10, 6 * 2.0**-10 * 1.0625, 6 * 2.0**-7, 1e-4]):
        t[:, 16 * (b + 1)] = vmax
        t[:, 16 * (b + 1) + 1: 16 * (b + 2)] = torch.linspace(-vmax, vmax, 15)
    out.append(("tiny", t.to(dtype)))
    big = 6.0e4 if dtype == torch.float16 else 3.0e38
    h = torch.randn(4, 48, generator=g) * big / 5
    h[:, 5] = big
    h[2, 20] = -big
    out.append(("huge", h.clamp(-big, big).to(dtype)))
    s = torch.randn(4, 32, generator=g)
    s[0, 3] = float("nan")
    s[1, 7] = -float("nan")
    s[2, :16] = float("nan")
    s[3, 9] = float("inf")
    s[3, 30] = -float("inf")
    out.append(("nan_inf", s.to(dtype)))
    out.append(("3d", (torch.randn(2, 3, 48, generator=g) * 10).to(dtype)))
    out.append(("1d", torch.randn(64, generator=g).to(dtype)))
    return out


def _on(device, *ts):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in ts]


# ------------------------------------------------------------------- bit-exact kernels vs reference

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_reference(device, dtype):
    for name, x in cases(dtype):
        gs_tensor = ref.fused_amax_quantize_ref(x)[2]
        gs_rows = ref.fused_amax_quantize_per_row_ref(x)[2]
        for gs_name, gs in [("tensor", gs_tensor), ("rows", gs_rows), ("one", torch.tensor(1.0)),
                            ("zero", torch.tensor(0.0))]:
            want = ref.nvfp4_quantize_ref(x, gs)
            got = OPS.nvfp4_quantize(*_on(device, x, gs))
            assert_bit_equal(got, want, f"{name}/{gs_name}")
            if device == "cuda":
                assert_bit_equal(got, OPS.nvfp4_quantize(x, gs), f"{name}/{gs_name} cuda vs cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row", [False, True])
def test_fused_amax_quantize_matches_reference(device, dtype, per_row):
    op = OPS.fused_amax_quantize_per_row if per_row else OPS.fused_amax_quantize
    ref_fn = ref.fused_amax_quantize_per_row_ref if per_row else ref.fused_amax_quantize_ref
    for name, x in cases(dtype):
        want = ref_fn(x)
        got = op(x.to(device))
        assert_bit_equal(got, want, name)
        if device == "cuda":
            assert_bit_equal(got, op(x), f"{name} cuda vs cpu")
        # The fused op is nvfp4_quantize with the scale it returns.
        assert_bit_equal(got[:2], OPS.nvfp4_quantize(x.to(device), got[2]), f"{name} fused vs two-step")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_matches_reference(device, out_dtype):
    for dtype in DTYPES:
        for name, x in cases(dtype):
            for packed, sf, gs in [ref.fused_amax_quantize_ref(x), ref.fused_amax_quantize_per_row_ref(x)]:
                want = ref.nvfp4_dequantize_ref(packed, sf, gs, out_dtype)
                got = OPS.nvfp4_dequantize(*_on(device, packed, sf, gs), out_dtype)
                assert_bit_equal(got, want, f"{dtype}/{name}")
                got = OPS.nvfp4_dequantize(*_on(device, packed, sf.view(torch.uint8), gs), out_dtype)
                assert_bit_equal(got, want, f"{dtype}/{name} (uint8 scales)")


def deint_cases(dtype):
    g = torch.Generator().manual_seed(99)
    a = torch.randn(5, 2 * 64, generator=g) * 8  # many values beyond the limit 10
    a[0, 0::2] = 10.0  # gate exactly at the limit
    a[1, 1::2] = -10.0
    a[2] = 0.0
    a[3, :32] = -0.0
    b = torch.randn(2, 3, 2 * 32, generator=g) * 3
    c = torch.randn(1, 2 * 16, generator=g) * 100
    c[0, 4] = -200.0  # silu underflows to -0
    return [("a", a.to(dtype)), ("b", b.to(dtype)), ("c", c.to(dtype))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_deinterleave_matches_reference(device, dtype, per_row, weighted):
    for name, gu in deint_cases(dtype):
        rows = gu[..., 0].numel()
        w = None
        if weighted:
            w = torch.rand(gu.shape[:-1], generator=torch.Generator().manual_seed(rows)) + 0.1
            w.view(-1)[0] = 0.0  # a zero routing weight zeroes its row
        for limit in (10.0, 3.5):
            want = ref.fused_deinterleave_amax_quantize_ref(gu, w, limit, per_row)
            got = OPS.fused_deinterleave_amax_quantize(*_on(device, gu, w), limit, per_row)
            assert_bit_equal(got, want, f"{name}/{limit}")
            if device == "cuda":
                assert_bit_equal(got, OPS.fused_deinterleave_amax_quantize(gu, w, limit, per_row), f"{name} cuda/cpu")


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (1, 4096), (3, 4096), (64, 7168), (300, 4096), (700, 7168),
                                   (2048, 7168), (3, 8192), (5, 12288), (2, 81920)])
def test_cuda_large_shapes_match_cpu(dtype, shape):
    """Every launch path of the CUDA kernels (one CTA, a cluster, the cooperative grid with and without
    re-read tiles, per-row rows longer than one pass) agrees bit for bit with the CPU kernel."""
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[0])[:, None]
    x.view(-1)[(x.numel() * 7) // 9] = 1000.0  # the amax far from the start
    x = x.to(dtype)
    xc = x.cuda()
    for op in (OPS.fused_amax_quantize, OPS.fused_amax_quantize_per_row):
        assert_bit_equal(op(xc), op(x), f"{op}")
    gs = ref.fused_amax_quantize_ref(x)[2]
    assert_bit_equal(OPS.nvfp4_quantize(xc, gs.cuda()), OPS.nvfp4_quantize(x, gs), "quantize")
    if shape[1] % 32 == 0:
        w = torch.rand(shape[0], generator=g)
        for per_row in (False, True):
            got = OPS.fused_deinterleave_amax_quantize(xc, w.cuda(), 10.0, per_row)
            assert_bit_equal(got, OPS.fused_deinterleave_amax_quantize(x, w, 10.0, per_row), f"deint {per_row}")


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("path", ["cluster", "grid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 4096), (64, 7168), (300, 4096)])
def test_cuda_forced_single_launch_paths(override_kernels, path, dtype, shape):
    """Both one-launch schemes of the per-tensor ops (cluster with several blocks per thread, cooperative grid
    with one or a few), forced through the nvfp4_fused_path override, match the CPU kernel."""
    override_kernels(nvfp4_fused_path=path)
    g = torch.Generator().manual_seed(shape[0] + 17)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x.view(-1)[-5] = -77.0
    assert_bit_equal(OPS.fused_amax_quantize(x.cuda()), OPS.fused_amax_quantize(x), "fused")
    w = torch.rand(shape[0], generator=g)
    assert_bit_equal(OPS.fused_deinterleave_amax_quantize(x.cuda(), w.cuda(), 10.0, False),
                     OPS.fused_deinterleave_amax_quantize(x, w, 10.0, False), "deint")


# ------------------------------------------------------------- independent checks of the reference

def _rne_bruteforce(a: torch.Tensor) -> torch.Tensor:
    """Nearest of the 8 E2M1 magnitudes in float64 (exact for fp32 inputs), ties to the even code;
    values above 6 saturate to 6."""
    grid = torch.tensor(ref.E2M1_VALUES, dtype=torch.float64)
    d = (a.double().clamp(max=6.0)[:, None] - grid[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best
    even = cand & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(1), even.float().argmax(1), cand.float().argmax(1))
    return code.to(torch.uint8)


def test_e2m1_threshold_form_equals_bruteforce_rne():
    g = torch.Generator().manual_seed(5)
    ties = torch.tensor(TIES + ref.E2M1_VALUES + (6.5, 1e30, 0.0))
    vals = torch.cat([
        _neighbours(ties.abs(), torch.float32),
        torch.rand(200_000, generator=g) * 7,
        torch.rand(20_000, generator=g) * 0.01,
        (torch.rand(4096, generator=g) * 14).round() / 4,  # multiples of 1/4 (all ties)
    ])
    want = _rne_bruteforce(vals)
    got = ref.e2m1_encode(vals, torch.zeros_like(vals, dtype=torch.bool))
    assert torch.equal(got, want)
    # Sign bit comes from `negative`, NaN saturates.
    assert ref.e2m1_encode(torch.tensor([-0.0, -0.1, float("nan")]), torch.tensor([True, True, False])).tolist() == [
        8, 8, 7]


def test_kernel_encoder_equals_bruteforce_rne():
    """Through the op: global scale 1 and a block maximum 6 make the element scale exactly 1, so y = x."""
    g = torch.Generator().manual_seed(6)
    vals = torch.cat([_neighbours(torch.tensor(TIES + ref.E2M1_VALUES[1:]), torch.float32),
                      torch.rand(15 * 2000, generator=g) * 6])
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % 15)])
    blocks = torch.cat([torch.full((vals.numel() // 15, 1), 6.0), vals.reshape(-1, 15)], dim=1)
    blocks = torch.cat([blocks, -blocks])
    packed, sf = OPS.nvfp4_quantize(blocks, torch.tensor(1.0))
    assert torch.all(sf.float() == 1.0)
    codes = ref.nvfp4_unpack(packed)
    want = _rne_bruteforce(blocks.abs().flatten()).reshape(blocks.shape)
    want = want | torch.where(torch.signbit(blocks), 8, 0).to(torch.uint8)
    assert torch.equal(codes, want)


def _e4m3_values() -> torch.Tensor:
    v = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(v, dtype=torch.float64)


def test_e4m3_cast_is_rne():
    """The fp8 cast the reference (and the CPU kernel, via c10) uses: round to nearest even on [0, 448]."""
    grid = _e4m3_values()  # ascending, codes 0..126
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(7)
    vals = torch.cat([grid, mids, mids * (1 + 2.0**-20), mids * (1 - 2.0**-20), torch.rand(50_000, generator=g) * 448,
                      torch.rand(10_000, generator=g) * 2.0**-6, torch.tensor([2.0**-10, 2.0**-11, 1e-30])]).float()
    d = (vals.double()[:, None] - grid[None, :]).abs()
    best = d.min(1, keepdim=True).values
    cand = d == best
    even = cand & (torch.arange(grid.numel()) % 2 == 0)
    code = torch.where(even.any(1), even.float().argmax(1), cand.float().argmax(1))
    want = grid[code].float()
    got = vals.to(torch.float8_e4m3fn).float()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_error_bound(dtype):
    """|dequant(quant(x)) - x| <= half the E2M1 gap at |y| (times the block's dequant scale d), or the
    saturation error above 6; a block with scale 0 is below the flush bound amax * 2^-10 / 448."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(64, 256, generator=g) * torch.logspace(-4, 4, 64)[:, None]).to(dtype)
    for packed, sf, gs in [OPS.fused_amax_quantize(x), OPS.fused_amax_quantize_per_row(x)]:
        deq = OPS.nvfp4_dequantize(packed, sf, gs, torch.float32).double()
        xd = x.double()
        d = (sf.double() * (gs.double() if gs.dim() == 0 else gs.double()[:, None]))
        d = d.repeat_interleave(16, dim=-1)
        y = (xd / d).abs()
        half_gap = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
        bound = torch.where(y <= 6, half_gap, y - 6) * d
        ok = d > 0
        err = (deq - xd).abs()
        assert torch.all(err[ok] <= bound[ok] + xd.abs()[ok] * 2.0**-22)  # slack: fp32 rounding of the dequant
        amax = (xd.abs().amax() if gs.dim() == 0 else xd.abs().amax(dim=-1, keepdim=True)).expand_as(xd)
        assert torch.all(xd.abs()[~ok] <= (amax * 2.0**-10 / 448)[~ok] * (1 + 2.0**-20))
        # The element holding the amax is reproduced to fp32 precision (its block scale is 448).
        if gs.dim() == 0:
            i = xd.abs().argmax()
            assert abs(deq.flatten()[i] - xd.flatten()[i]) <= xd.abs().max() * 2.0**-21
            assert sf.float().max() == 448


def test_modelopt_convention_roundtrip():
    """An independent ModelOpt-style quantizer (weight_scale_2 = amax/2688, block scale = vmax/(6*ws2) cast to
    e4m3, q = RNE(x / (scale * ws2)) via brute force) agrees with ours up to last-ulp scale arithmetic."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(128, 512, generator=g) * 3
    packed, sf, gs = OPS.fused_amax_quantize(x)
    ws2 = x.abs().amax().double() / 2688.0
    assert abs(gs.double() - ws2) <= ws2 * 2.0**-23
    blocks = x.double().reshape(128, 32, 16)
    mo_sf = (blocks.abs().amax(-1) / (6 * ws2)).clamp(max=448).float().to(torch.float8_e4m3fn)
    assert (mo_sf.view(torch.uint8) != sf.view(torch.uint8)).float().mean() < 1e-3
    y = blocks / (mo_sf.double()[..., None] * ws2)
    codes = _rne_bruteforce(y.abs().flatten()).reshape(128, 512) | torch.where(x < 0, 8, 0).to(torch.uint8)
    ours = ref.nvfp4_unpack(packed)
    assert (codes != ours).float().mean() < 1e-3
    # ModelOpt dequant: code value * block scale * weight_scale_2.
    mo_deq = (ref.e2m1_decode(codes).double().reshape(128, 32, 16) * mo_sf.double()[..., None] * ws2).reshape(128, 512)
    ours_deq = OPS.nvfp4_dequantize(packed, sf, gs, torch.float32).double()
    assert (mo_deq - ours_deq).abs().mean() < 1e-3 * x.abs().mean()


def test_swiglu_reference_vs_torch_silu():
    g = torch.Generator().manual_seed(10)
    gu = torch.randn(64, 2 * 256, generator=g) * 12
    gate, up = gu[:, 0::2].double(), gu[:, 1::2].double()
    want = torch.nn.functional.silu(gate.clamp(max=10)) * up.clamp(-10, 10)
    got = ref.swiglu_limited_ref(gu, None, 10.0).double()
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)
    t = torch.linspace(-87, 88, 100_001)
    torch.testing.assert_close(ref.exp_portable(t).double(), torch.exp(t.double()), rtol=2.5e-7, atol=0)


def test_special_value_policy():
    # amax == 0: all-zero scales and global scale, codes 0 (0x8 for -0), never inf/NaN.
    x = torch.zeros(2, 32)
    x[1, 3] = -0.0
    packed, sf, gs = OPS.fused_amax_quantize(x)
    assert gs.item() == 0 and torch.all(sf.float() == 0)
    codes = ref.nvfp4_unpack(packed)
    assert codes[1, 3] == 8 and codes.sum() == 8
    # NaN: skipped by the amax, encoded as 6 with its sign; a small negative that rounds to 0 keeps 0x8.
    x = torch.tensor([[1.0, float("nan"), -float("nan"), -1e-3] + [0.5] * 12])
    packed, sf, gs = OPS.fused_amax_quantize(x)
    assert gs.item() == pytest.approx(1 / 2688)
    assert ref.nvfp4_unpack(packed)[0, :4].tolist() == [7, 7, 15, 8]


# --------------------------------------------------------------------------- opcheck / fake / compile

def _samples(device):
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(4, 32, generator=g).to(torch.bfloat16), torch.randn(2, 3, 16, generator=g),
          (torch.randn(64, generator=g) * 100).half()]
    out = []
    for x in xs:
        x = x.to(device)
        gs_t = torch.tensor(0.01, device=device)
        gs_r = torch.rand(x.shape[:-1], generator=g).to(device) * 0.01 + 1e-3
        p, s, gsr = OPS.fused_amax_quantize_per_row(x)
        out += [
            (OPS.nvfp4_quantize, (x, gs_t)),
            (OPS.nvfp4_quantize, (x, gs_r)),
            (OPS.nvfp4_dequantize, (p, s, gsr, torch.bfloat16)),
            (OPS.nvfp4_dequantize, (p, s, torch.tensor(0.5, device=device), torch.float32)),
            (OPS.fused_amax_quantize, (x,)),
            (OPS.fused_amax_quantize_per_row, (x,)),
        ]
        if x.shape[-1] % 32 == 0:
            w = torch.rand(x.shape[:-1], generator=g).to(device)
            out += [(OPS.fused_deinterleave_amax_quantize, (x, w, 10.0, False)),
                    (OPS.fused_deinterleave_amax_quantize, (x, None, 7.0, True))]
    return out


DEFAULT_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in _samples(device):
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args):
            # torch's SchemaCheckMode compares inputs with allclose, which has no float8 kernel: run the other
            # three checks here; the uint8 form of the same bytes gets all four below.
            torch.library.opcheck(op, args, test_utils=DEFAULT_CHECKS[1:])
            args = tuple(a.view(torch.uint8) if isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn
                         else a for a in args)
        torch.library.opcheck(op, args, test_utils=DEFAULT_CHECKS)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fake_shapes(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def check(make):
        x = make((2, 5, 64), torch.bfloat16)
        p, s = OPS.nvfp4_quantize(x, make((), torch.float32))
        assert (p.shape, p.dtype, s.shape, s.dtype) == ((2, 5, 32), torch.uint8, (2, 5, 4), torch.float8_e4m3fn)
        for op, gshape in [(OPS.fused_amax_quantize, ()), (OPS.fused_amax_quantize_per_row, (2, 5))]:
            p, s, gs = op(x)
            assert p.shape == (2, 5, 32) and s.shape == (2, 5, 4) and gs.shape == gshape
            assert gs.dtype == torch.float32 and p.is_contiguous() and s.is_contiguous()
        d = OPS.nvfp4_dequantize(p, s, make((2, 5), torch.float32), torch.float16)
        assert d.shape == (2, 5, 64) and d.dtype == torch.float16
        p, s, gs = OPS.fused_deinterleave_amax_quantize(x, make((2, 5), torch.float32), 10.0, True)
        assert p.shape == (2, 5, 16) and s.shape == (2, 5, 2) and gs.shape == (2, 5)
        p, s, gs = OPS.fused_deinterleave_amax_quantize(x, None, 10.0, False)
        assert gs.shape == ()

    if device == "meta":
        check(lambda shape, dt: torch.empty(shape, dtype=dt, device="meta"))
    else:
        with FakeTensorMode():
            check(lambda shape, dt: torch.empty(shape, dtype=dt))


def test_input_checks():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        OPS.fused_amax_quantize(torch.randn(4, 24))
    with pytest.raises(RuntimeError, match="bfloat16, float16 or float32"):
        OPS.fused_amax_quantize(torch.randn(4, 32).double())
    with pytest.raises(RuntimeError, match="global_scale"):
        OPS.nvfp4_quantize(torch.randn(4, 32), torch.ones(3))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OPS.fused_deinterleave_amax_quantize(torch.randn(4, 48), None, 10.0, False)
    with pytest.raises(RuntimeError, match="row_weight"):
        OPS.fused_deinterleave_amax_quantize(torch.randn(4, 64), torch.ones(3), 10.0, False)


def _compile_fns():
    return {
        "quantize": lambda x, gs: OPS.nvfp4_quantize(x, gs),
        "roundtrip": lambda x, gs: OPS.nvfp4_dequantize(*OPS.nvfp4_quantize(x, gs), gs, torch.float32),
        "fused": lambda x, gs: OPS.fused_amax_quantize(x),
        "fused_row": lambda x, gs: OPS.fused_amax_quantize_per_row(x * 2),
        "deint": lambda x, gs: OPS.fused_deinterleave_amax_quantize(x, gs.expand(x.shape[:-1]).contiguous(), 10.0,
                                                                    False),
    }


@pytest.mark.parametrize("name", list(_compile_fns()))
def test_compile_fullgraph_cpu(name):
    from torch._dynamo.utils import counters

    fn = _compile_fns()[name]
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    for shape in [(4, 64), (8, 64)]:
        x = torch.randn(shape) * 3
        gs = torch.tensor(0.005)
        assert_bit_equal(compiled(x, gs), fn(x, gs), name)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("name", list(_compile_fns()))
@pytest.mark.parametrize("shape", [(1, 4096), (64, 7168), (2048, 7168)])
def test_cuda_graph_replay(name, shape):
    """Captured once, replayed on new data (the cooperative kernel's scratch must reset itself), twice in one
    graph, with sync debug mode 'error' around every launch."""
    fn = _compile_fns()[name]
    gen = torch.Generator().manual_seed(12)
    static_x = (torch.randn(shape, generator=gen) * 4).cuda()
    gs = torch.tensor(0.004, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn(static_x, gs)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out1 = fn(static_x, gs)
            out2 = fn(static_x * 0.5, gs)
        torch.cuda.set_sync_debug_mode("default")
        for it in range(3):
            new = (torch.randn(shape, generator=gen) * (it + 1) * 10).cuda()
            torch.cuda.set_sync_debug_mode("error")
            static_x.copy_(new)
            graph.replay()
            want1, want2 = fn(new, gs), fn(new * 0.5, gs)
            torch.cuda.set_sync_debug_mode("default")
            assert_bit_equal(out1, want1, f"{name} replay {it}")
            assert_bit_equal(out2, want2, f"{name} replay {it} (second call)")
    finally:
        torch.cuda.set_sync_debug_mode("default")
