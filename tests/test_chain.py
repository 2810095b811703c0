"""dsv4::nvfp4_linear_chain: dependent NVFP4 linears in one launch. The op is defined as the per-op calls in order
(nvfp4_linear / nvfp4_linear_grouped), so it is held to them bit for bit on both devices (on the GPU that means
its one persistent launch reproduces the gemv kernel's work split), and to the reference chain
(dsv4_ops.reference.nvfp4_linear_chain_ref) within one bf16 rounding per stage carried through the stages after it.
"""
import pytest
import torch

from dsv4_ops import ops as dops
from dsv4_ops import reference as ref
from dsv4_ops.overrides import kernel_overrides
from dsv4_model.quant import nvfp4 as nv
from tests.test_nvfp4_gemm import bf16_ulp, rand_nvfp4, rand_x

ops = torch.ops.dsv4


def make_stages(specs, gen, device):
    """specs: (G or 0, N, K) per stage. Returns canonical stages (the reference's) and kernel-layout ones."""
    canon, kern = [], []
    for g, n, k in specs:
        packed, scale, gs = rand_nvfp4((g,) if g else (), n, k, gen, device)
        wk, sk = nv.repack_weight(packed, scale)
        canon.append((packed, scale, gs))
        kern.append((wk, sk, gs))
    return canon, kern


def per_op(x, kern):
    """The chain's definition: one per-op call per stage."""
    h = x
    for i, (w, s, g) in enumerate(kern):
        if w.dim() == 3:
            h = ops.nvfp4_linear_grouped(h if i == 0 else h.unflatten(-1, (w.shape[0], -1)), w, s, g)
            h = h if i == len(kern) - 1 else h.flatten(-2)
        else:
            h = ops.nvfp4_linear(h, w, s, g)
    return h


def new_sync(w_packed, device="cpu", extra=0):
    n = dops.nvfp4_linear_chain_sync_numel(dops.nvfp4_linear_chain_widths(w_packed))
    return torch.zeros(n + extra, dtype=torch.int32, device=device)


def chain(x, kern, sync=None):
    w, s, g = (list(t) for t in zip(*kern))
    if sync is None:
        sync = new_sync(w, x.device)
    return dops.nvfp4_linear_chain(x, w_packed=w, w_scale=s, w_global_scale=g, sync=sync)


def assert_near_reference(out, x, canon, what):
    """|out - ref| <= one bf16 ulp of the last stage's exact value + its fp32 reordering bound + one ulp of every
    intermediate value carried through the stages after it (|W| times the ulps)."""
    h32 = x.float()
    slack = torch.zeros_like(h32)
    for i, (packed, scale, gs) in enumerate(canon):
        w = ref.nvfp4_gemm_dequant_ref(packed, scale, gs)
        if w.dim() == 3:
            hx = h32 if i == 0 else h32.unflatten(-1, (w.shape[0], -1))
            sx = slack if i == 0 else slack.unflatten(-1, (w.shape[0], -1))
            exact = torch.einsum("...gk,gnk->...gn", hx, w)
            bound = torch.einsum("...gk,gnk->...gn", hx.abs(), w.abs())
            carried = torch.einsum("...gk,gnk->...gn", sx, w.abs())
        else:
            exact, bound, carried = h32 @ w.t(), h32.abs() @ w.abs().t(), slack @ w.abs().t()
        tol = bf16_ulp(exact) + 4e-5 * bound + carried + 1e-30
        if i == len(canon) - 1:
            err = (out.float() - exact).abs()
            bad = ~(err <= tol)
            assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {bad.numel()} outside tolerance"
        else:
            h32 = exact.to(torch.bfloat16).float()
            slack = (tol + bf16_ulp(exact)).flatten(-2) if w.dim() == 3 else tol + bf16_ulp(exact)
            if w.dim() == 3:
                h32 = h32.flatten(-2)


# wo_a -> wo_b at a small width; a three-stage chain ending grouped; one stage alone
SHAPES = {
    "grouped_then_plain": ((4, 128, 256), (0, 96, 512)),
    "three_stages": ((0, 256, 208), (0, 256, 256), (2, 40, 128)),
    "one_stage": ((0, 48, 144),),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 2)])
def test_chain_cpu_is_the_per_op_calls_and_near_the_reference(name, lead):
    specs = SHAPES[name]
    gen = torch.Generator().manual_seed(len(specs) * 100 + sum(lead))
    canon, kern = make_stages(specs, gen, "cpu")
    g0, _, k0 = specs[0]
    x = rand_x((*lead, g0, k0) if g0 else (*lead, k0), gen)
    out = chain(x, kern)
    want = per_op(x, kern)
    assert out.shape == want.shape and torch.equal(out, want), f"{name} {lead}: not the per-op calls' bits"
    assert_near_reference(out, x, canon, f"{name} {lead}")
    assert_near_reference(ref.nvfp4_linear_chain_ref(x, canon), x, canon, f"reference {name} {lead}")


def test_chain_sync_numel_counts_the_intermediate_chunks():
    gen = torch.Generator().manual_seed(4)
    _, kern = make_stages(SHAPES["three_stages"], gen, "cpu")
    w = [t[0] for t in kern]
    assert dops.nvfp4_linear_chain_sync_numel(dops.nvfp4_linear_chain_widths(w)) == 1 + 256 // 128 + 256 // 128
    x = rand_x((1, 208), gen)
    short = new_sync(w, extra=-1)
    with pytest.raises(RuntimeError, match=r"nvfp4_linear_chain: sync must be contiguous int32 \[>= 5\]"):
        chain(x, kern, short)
    with pytest.raises(RuntimeError, match=r"\(not contiguous\)"):
        chain(x, kern, new_sync(w, extra=6)[::2])


def test_chain_bad_args_name_the_argument():
    gen = torch.Generator().manual_seed(5)
    _, kern = make_stages(((0, 208, 256), (0, 64, 208)), gen, "cpu")
    x = rand_x((1, 256), gen)
    with pytest.raises(RuntimeError, match=r"w_packed\[1\]'s K = 208 .* multiple of 128"):
        chain(x, kern, torch.zeros(8, dtype=torch.int32))
    _, kern = make_stages(((0, 128, 256), (0, 64, 128)), gen, "cpu")
    with pytest.raises(RuntimeError, match=r"sync must be contiguous int32"):
        chain(x, kern, torch.zeros(8, dtype=torch.int64))
    w, s, g = (list(t) for t in zip(*kern))
    with pytest.raises(RuntimeError, match=r"out must be bf16 \[1, 64\]"):
        ops.nvfp4_linear_chain(x, w, s, g, torch.empty(1, 65, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"w_packed\[0\] must be \[N, Kp/2\] or \[G, N, Kp/2\]"):
        ops.nvfp4_linear_chain(x, [w[0][None, None]], s[:1], g[:1], torch.empty(1, 128, dtype=torch.bfloat16),
                               torch.zeros(8, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"w_packed\[0\] must hold at least one matrix"):
        ops.nvfp4_linear_chain(x[:, None], [w[0][:0, None]], [s[0][:0, None]], [g[0].reshape(1)[:0]],
                               torch.empty(1, 0, 128, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"lists of one length, 1 to 4"):
        ops.nvfp4_linear_chain(x, w, s[:1], g, torch.empty(1, 64, dtype=torch.bfloat16),
                               torch.zeros(8, dtype=torch.int32))


def opcheck_cases(device):
    gen = torch.Generator().manual_seed(6)
    cases = []
    for name, lead in (("grouped_then_plain", (3,)), ("three_stages", (2,))):
        specs = SHAPES[name]
        _, kern = make_stages(specs, gen, device)
        g0, _, k0 = specs[0]
        x = rand_x((*lead, g0, k0) if g0 else (*lead, k0), gen, device)
        w, s, g = (list(t) for t in zip(*kern))
        out = per_op(x, kern)
        sync = new_sync(w, device)
        cases.append((x, w, s, g, torch.empty_like(out), sync))
    return cases


def test_opcheck_cpu():
    for args in opcheck_cases("cpu"):
        torch.library.opcheck(ops.nvfp4_linear_chain.default, args)


def test_chain_compiles_fullgraph_to_the_eager_bits():
    gen = torch.Generator().manual_seed(8)
    _, kern = make_stages(SHAPES["grouped_then_plain"], gen, "cpu")
    sync = new_sync([w for w, _, _ in kern])

    def f(x):
        return chain(x, kern, sync) * 2

    x = rand_x((2, 4, 256), gen)
    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    assert torch.equal(compiled(x), f(x))


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("name", ["wo_a_wo_b", "wo_a_wo_b_small", "three_stages", "one_stage"])
def test_chain_cuda_one_launch_gives_the_per_op_bits(name):
    specs = {"wo_a_wo_b": ((8, 1024, 4096), (0, 4096, 8192)), "wo_a_wo_b_small": ((4, 128, 256), (0, 96, 512)),
             "three_stages": SHAPES["three_stages"], "one_stage": SHAPES["one_stage"]}[name]
    gen = torch.Generator().manual_seed(len(name))
    canon, kern = make_stages(specs, gen, "cuda")
    g0, _, k0 = specs[0]
    w = [t[0] for t in kern]
    sync = new_sync(w, "cuda")
    for m in (1, 2, 3, 8):
        x = rand_x((m, g0, k0) if g0 else (m, k0), gen, "cuda")
        want = per_op(x, kern)
        for pdl in (True, False):
            with kernel_overrides(pdl=pdl):
                got = chain(x, kern, sync)
            assert torch.equal(got, want), f"{name} m={m} pdl={pdl}: not the per-op bits"
            assert not bool(sync.any()), f"{name} m={m}: sync not left zero"
        if m in (1, 8):
            assert_near_reference(got, x, canon, f"cuda {name} m={m}")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                chain(x, kern, sync)
                torch.cuda.synchronize()
            ran = [e.name for e in prof.events()]
            assert any("nvfp4_chain_kernel" in n for n in ran) and not any("gemv_kernel" in n for n in ran), ran


@pytest.mark.cuda
@pytest.mark.kernels
def test_chain_cuda_odd_operands():
    """A longer sync (left zero), an output view that is not contiguous, an input that is not 16-byte aligned."""
    gen = torch.Generator().manual_seed(13)
    _, kern = make_stages(((4, 128, 256), (0, 96, 512)), gen, "cuda")
    w, s, g = (list(t) for t in zip(*kern))
    sync = new_sync(w, "cuda", extra=7)
    base = rand_x((3 * 4 * 256 + 1,), gen, "cuda")
    x = base[1:].view(3, 4, 256)  # 2-byte offset
    want = per_op(x.clone(), kern)
    out = torch.full((96, 3), 7.0, dtype=torch.bfloat16, device="cuda")
    ops.nvfp4_linear_chain(x, w, s, g, out.t(), sync)
    assert torch.equal(out.t(), want) and not bool(sync.any())


@pytest.mark.cuda
@pytest.mark.kernels
def test_chain_cuda_beyond_decode_rows_and_forced_kernels_run_per_op():
    gen = torch.Generator().manual_seed(11)
    _, kern = make_stages(((4, 128, 256), (0, 96, 512)), gen, "cuda")
    x = rand_x((40, 4, 256), gen, "cuda")
    assert torch.equal(chain(x, kern), per_op(x, kern))
    x = rand_x((2, 4, 256), gen, "cuda")
    with kernel_overrides(nvfp4_gemm_kernel="skinny"):
        assert torch.equal(chain(x, kern), per_op(x, kern))


@pytest.mark.cuda
@pytest.mark.kernels
def test_chain_cuda_graph_replays_to_the_same_bits():
    gen = torch.Generator().manual_seed(12)
    _, kern = make_stages(((8, 1024, 4096), (0, 4096, 8192)), gen, "cuda")
    x = rand_x((1, 8, 4096), gen, "cuda")
    sync = new_sync([t[0] for t in kern], "cuda")
    want = per_op(x, kern)
    chain(x, kern, sync)  # warm-up outside the capture (kernel attributes)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = chain(x, kern, sync)
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and not bool(sync.any())


@pytest.mark.cuda
def test_opcheck_cuda():
    for args in opcheck_cases("cuda"):
        torch.library.opcheck(ops.nvfp4_linear_chain.default, args)
