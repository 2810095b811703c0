"""Benchmark of dsv4::nvfp4_linear (W4A16) and dsv4::nvfp4_moe on the H200, against bf16 PyTorch peers.

Linear: DeepSeek-V4-Flash projection shapes (N x K) at M = 1, 8, 16, 32, 64, 128, 256, 512, 1024, 4096 tokens;
peer = torch.matmul with a bf16 weight of the same shape (cuBLAS). Grouped (wo_a, 8 x (1024 x 4096)):
dsv4::nvfp4_linear_grouped vs torch.bmm on bf16 weights and vs 8 nvfp4_linear calls. Multi (wq_a + wkv; wq_b +
the indexer's wq_b): dsv4::nvfp4_linear_multi vs two torch.matmul and two nvfp4_linear calls. MoE: 256 experts,
top-6 (uniform random routing), d = 4096, I = 2048, T = 1 ... 8192 tokens, routed only and routed + shared expert;
peer = a per-expert bf16 loop in torch (index_select, 3 matmuls, clamped SwiGLU, index_add_) for the same routing,
captured in a CUDA graph; at 8 < T <= 64 also with the gemv kernel in 2-token passes (moe_gemv_rows=2; the auto choice to T = 8).
Beside: dsv4::nvfp4_fp32_linear_multi (wq_a + wkv with the fp32-math projections of the same x), the fp32 kernel
beside the gemv vs after it (the `beside` override) and each part alone.
Head: V4-Flash's head (129280 x 4096, fp32 logits) stored bf16 (dsv4::fp32_linear) vs NVFP4 (head_quant); the
built-in model's (4096 x 256) the same.

Every figure is a CUDA-graph replay of REPS back-to-back calls divided by REPS (best of 3 replays). Calls cycle
through copies of the weights totalling >= 256 MB, so every call streams its weights from HBM (no L2 reuse across
calls), for both the op and the peer. GB/s counts weight bytes (NVFP4: codes + block scales; MoE: the unique
experts touched); "HBM" is that over 4.26 TB/s. TF/s = 2*M*N*K / time.

Run: python bench/bench_nvfp4_gemm.py   (about a minute; BENCH_NVFP4_PARTS=linear,grouped,multi,beside,moe picks tables)
"""
import math
import os
import time

import torch
import torch.nn.functional as F

import os as _os
import sys as _sys

# runnable as `python3 bench/<file>.py` from a checkout: the repository root holds dsv4_ops
_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402,F401
from dsv4_ops.overrides import kernel_overrides  # noqa: E402
from timing import graph_us as _graph_us  # noqa: E402

ops = torch.ops.dsv4
HBM = 4.26e12
ROTATE_BYTES = 256 << 20
SHAPES = [  # (name, N, K) of y[M, N] = x[M, K] @ W^T
    ("wq_a", 1024, 4096),
    ("wq_b", 32768, 1024),
    ("wkv", 512, 4096),
    ("wo_b", 4096, 8192),
    ("w1+w3", 4096, 4096),  # shared expert (and a fused routed expert)
    ("w2", 4096, 2048),  # shared / routed expert
    ("expert w1", 2048, 4096),
]
MS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
E, D, INTER, TOPK = 256, 4096, 2048, 6


def graph_us(fn, reps):
    return _graph_us(fn, reps, indexed=True)


def kernel_choice(name):
    return kernel_overrides(nvfp4_gemm_kernel=name)


def reps_for(bytes_moved, flops, out_bytes):
    t = max(bytes_moved / 3.0e12, flops / 4.0e14) + 4e-6
    r = int(4e-3 / t)
    r = min(r, max(1, int(2e9 // max(out_bytes, 1))))
    return max(2, min(r, 64))


def rand_kernel_weight(lead, n, k, gen):
    """Random NVFP4 weight directly in the kernel layout (any bytes are valid codes; scale bytes in 2^-3..2^2)."""
    kp = (k + 127) // 128 * 128
    packed = torch.randint(0, 256, (*lead, n, kp // 2), device="cuda", dtype=torch.uint8, generator=gen)
    scale = torch.randint(56, 96, (*lead, n, kp // 16), device="cuda", dtype=torch.uint8, generator=gen)
    return packed, scale


def nvfp4_bytes(n, k):
    return n * k // 2 + n * k // 16


def linear_at(m, n, k, ws, wb, gs, gen):
    """M = m random rows for the N x K weights of rotated_weights: (flops, the op call cycling through ws, its
    reps, bf16 cuBLAS's us on the same rows)."""
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    flops = 2.0 * m * n * k
    t_peer = graph_us(lambda i: torch.matmul(x, wb[i % len(wb)].t()), reps_for(n * k * 2, flops, m * n * 2))
    return (flops, lambda i: ops.nvfp4_linear(x, ws[i % len(ws)][0], ws[i % len(ws)][1], gs),
            reps_for(nvfp4_bytes(n, k), flops, m * n * 2), t_peer)


def rotated_weights(n, k, gen):
    """Copies of one random N x K NVFP4 weight (codes, scales) and of a bf16 one, each set >= ROTATE_BYTES, so
    that calls cycling through them stream every weight from HBM; and a global scale."""
    copies = max(1, min(256, math.ceil(ROTATE_BYTES / nvfp4_bytes(n, k))))
    bcopies = max(1, min(64, math.ceil(ROTATE_BYTES / (n * k * 2))))
    ws = [rand_kernel_weight((), n, k, gen) for _ in range(copies)]
    wb = [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(bcopies)]
    return ws, wb, torch.tensor(0.01, device="cuda")


def bench_linear(gen):
    print("\n## nvfp4_linear (W4A16) vs bf16 torch.matmul (cuBLAS), CUDA-graph replay, weights streamed from HBM")
    print("(M > 8: 'nvfp4 us' is the default path -- tiled mma kernel (K split over a cluster where tiles are few) "
          "for M < 32, wgmma kernel for 32 <= M <= 1024, dequantize + cuBLAS above; M > 64: 'tiled' / 'deq+cuBLAS' / 'wgmma' / 'wide' (wgmma, 256-row tiles) force each path; "
          "8 < M <= 64: 'skinny' / 'tiled' / 'wgmma' / 'wide' forced, each against the default's time; M <= 8: 'nvfp4 us' is the gemv kernel "
          "(default, cp.async ring, programmatic dependent launch), 'no-PDL' the same without PDL, 'skinny' the "
          "M <= 64 kernel)")
    hdr = (f"{'proj':>13} {'N x K':>12} {'M':>5} | {'nvfp4 us':>9} {'bf16 us':>9} {'speedup':>7} | "
           f"{'GB/s':>7} {'HBM':>5} | {'TF/s':>6} {'bf16 TF/s':>9} | {'tiled us':>8} {'deq+cuBLAS':>10} {'wgmma us':>8} {'':>11} {'wide us':>8}")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for name, n, k in SHAPES:
        wbytes = nvfp4_bytes(n, k)
        ws, wb, gs = rotated_weights(n, k, gen)
        for m in MS:
            flops, op, reps, t_peer = linear_at(m, n, k, ws, wb, gs, gen)
            t_op = graph_us(op, reps)
            alt = ""
            if m <= 8:  # the default gemv kernel without PDL, and the skinny kernel; same weights and reps
                ts = []
                with kernel_overrides(pdl=False):
                    ts.append(graph_us(op, reps))
                with kernel_choice("skinny"):
                    ts.append(graph_us(op, reps))
                alt = "".join(f" | {lab} {t:6.2f} us ({wbytes / (t * 1e-6) / HBM:4.0%})"
                              for lab, t in (("no-PDL", ts[0]), ("skinny", ts[1])))
            if 8 < m <= 64:
                ts = []
                for choice in ("skinny", "tiled", "wgmma", "wgmma_wide"):
                    with kernel_choice(choice):
                        ts.append(graph_us(op, reps))
                alt = "".join(f" | {lab} {t:6.2f} us ({t / t_op:4.2f}x the default's time)"
                              for lab, t in zip(("skinny", "tiled", "wgmma", "wide"), ts))
            if m > 64:
                ts = []
                for choice in ("tiled", "cublas", "wgmma", "wgmma_wide"):
                    with kernel_choice(choice):
                        ts.append(graph_us(op, reps))
                alt = (f" | {ts[0]:8.1f} {ts[1]:10.1f} {ts[2]:8.1f} ({t_peer / ts[2]:4.2f}x bf16) {ts[3]:8.1f} "
                       f"({t_peer / ts[3]:4.2f}x bf16)")
            gbs = wbytes / (t_op * 1e-6)
            print(f"{name:>13} {f'{n}x{k}':>12} {m:>5} | {t_op:9.2f} {t_peer:9.2f} {t_peer / t_op:6.2f}x | "
                  f"{gbs / 1e9:7.0f} {gbs / HBM:5.0%} | {flops / t_op * 1e-6:6.1f} {flops / t_peer * 1e-6:9.1f}"
                  + alt)
            rows.append((name, n, k, m, t_op, t_peer))
        del ws, wb
        torch.cuda.empty_cache()
    return rows


def _fused_header(title, label, peer, split):
    print(title)
    hdr = f"{'M':>5} | {label:>10} {peer:>11} {'speedup':>7} | {'GB/s':>7} {'HBM':>5} | {split:>13}"
    print(hdr)
    print("-" * len(hdr))


def _fused_row(m, wbytes, flops, out_bytes, op, peer, split):
    """One row of the one-launch tables: the op, its bf16 cuBLAS peer and the same work as separate calls."""
    reps = reps_for(wbytes, flops, out_bytes)
    t_op, t_peer, t_split = (graph_us(f, reps) for f in (op, peer, split))
    gbs = wbytes / (t_op * 1e-6)
    print(f"{m:>5} | {t_op:10.2f} {t_peer:11.2f} {t_peer / t_op:6.2f}x | {gbs / 1e9:7.0f} {gbs / HBM:5.0%} | "
          f"{t_split:13.2f}")
    return m, t_op, t_peer, t_split


def _forced(m, wbytes, kernel, op):
    """One line: the op under the nvfp4_gemm_kernel override `kernel`."""
    with kernel_choice(kernel):
        t = graph_us(op, reps_for(wbytes, 0.0, 0))
    print(f"{m:>5} | {kernel} (forced): {t:10.2f} us")


def bench_grouped(gen):
    g, n, k = 8, 1024, 4096  # V4-Flash attention wo_a: 8 groups of 1024 x 4096
    _fused_header(f"\n## nvfp4_linear_grouped (wo_a, {g} x ({n}x{k}), one launch: skinny below 32 rows, wgmma to 1024) vs bf16 torch.bmm "
                  "(cuBLAS), and vs 8 nvfp4_linear calls", "grouped us", "bf16 bmm us", "8 x linear us")
    wbytes = g * nvfp4_bytes(n, k)
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / wbytes)))
    ws = [rand_kernel_weight((g,), n, k, gen) for _ in range(copies)]
    gs = torch.full((g,), 0.01, device="cuda")
    bcopies = max(1, min(16, math.ceil(ROTATE_BYTES / (g * n * k * 2))))
    wb = [torch.randn(g, n, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(bcopies)]
    rows = []
    for m in (1, 8, 32, 64, 256):
        x = torch.randn(m, g, k, device="cuda", generator=gen).to(torch.bfloat16)
        xt = x.transpose(0, 1).contiguous()  # the peer's [G, M, K]
        xs = [x[:, j].contiguous() for j in range(g)]

        def loop(i):
            w, sc = ws[i % copies]
            return [ops.nvfp4_linear(xs[j], w[j], sc[j], gs[j]) for j in range(g)]

        rows.append(_fused_row(m, wbytes, 2.0 * m * g * n * k, m * g * n * 2,
                               lambda i: ops.nvfp4_linear_grouped(x, ws[i % copies][0], ws[i % copies][1], gs),
                               lambda i: torch.bmm(xt, wb[i % bcopies].transpose(1, 2)), loop))
        if 8 < m <= 64:  # the one-launch skinny kernel the auto rule left at 32 rows
            _forced(m, wbytes, "skinny", lambda i: ops.nvfp4_linear_grouped(x, ws[i % copies][0], ws[i % copies][1], gs))
    del ws, wb
    torch.cuda.empty_cache()
    return rows


def bench_multi(gen):
    # V4-Flash's two one-launch pairs: wq_a + wkv (both read the layer input x) and the attention's wq_b + the
    # indexer's wq_b (both read q_lora); M = 16 is a B = 16 decode or a speculative B = 8, K = 1 verification
    for ns, k, what in (((1024, 512), 4096, "wq_a + wkv"), ((32768, 8192), 1024, "wq_b + indexer wq_b")):
        _bench_multi_pair(gen, ns, k, what)


def _bench_multi_pair(gen, ns, k, what):
    _fused_header(f"\n## nvfp4_linear_multi ({what}, {ns[0]}+{ns[1]} x {k}, one launch at M <= 8, per matrix from "
                  "9) vs bf16 cuBLAS (two matmuls) and vs two nvfp4_linear calls", "multi us", "bf16 us",
                  "2 x linear us")
    wbytes = sum(nvfp4_bytes(n, k) for n in ns)
    copies = max(1, min(256, math.ceil(ROTATE_BYTES / wbytes)))
    ws = [[rand_kernel_weight((), n, k, gen) for n in ns] for _ in range(copies)]
    gs = [torch.tensor(0.01, device="cuda") for _ in ns]
    bcopies = max(1, min(64, math.ceil(ROTATE_BYTES / (sum(ns) * k * 2))))
    wb = [[torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) for n in ns] for _ in range(bcopies)]
    for m in (1, 8, 16, 24, 32, 64):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        if 8 < m <= 64:
            _forced(m, wbytes, "skinny", lambda i: ops.nvfp4_linear_multi(
                x, [w[0] for w in ws[i % copies]], [w[1] for w in ws[i % copies]], gs))
        _fused_row(
            m, wbytes, 2.0 * m * sum(ns) * k, m * sum(ns) * 2,
            lambda i: ops.nvfp4_linear_multi(x, [w[0] for w in ws[i % copies]], [w[1] for w in ws[i % copies]], gs),
            lambda i: [torch.matmul(x, w.t()) for w in wb[i % bcopies]],
            lambda i: [ops.nvfp4_linear(x, w[0], w[1], g) for w, g in zip(ws[i % copies], gs)])
    del ws, wb
    torch.cuda.empty_cache()


def bench_beside(gen):
    """nvfp4_fp32_linear_multi as attention decode calls it: wq_a + wkv (NVFP4) and the fp32-math projections of
    the same x (two compressors' wkv / wgate, the indexer's weights_proj; bf16 weights as the model holds them), the
    fp32 kernel beside the gemv (beside=1) and after it (the default), against each part alone; the most the
    overlap can save is the shorter part's time."""
    ns, fns, k = (1024, 512), (1024, 1024, 256, 256, 64), 4096
    wbytes = sum(nvfp4_bytes(n, k) for n in ns) + sum(fns) * k * 2
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / wbytes)))
    ws = [[rand_kernel_weight((), n, k, gen) for n in ns] for _ in range(copies)]
    fw = [[torch.randn(n, k, device="cuda", generator=gen).div(64).to(torch.bfloat16) for n in fns]
          for _ in range(copies)]
    gs = [torch.tensor(0.01, device="cuda") for _ in ns]
    print(f"\n## nvfp4_fp32_linear_multi: wq_a + wkv (NVFP4) with the fp32 projections of x ({'+'.join(map(str, fns))}"
          f" x {k}, bf16), {wbytes / 1e6:.1f} MB; floor = bytes / HBM")
    print(f"{'M':>3} | {'beside us':>9} {'after us':>9} {'saved':>6} | {'gemv us':>8} {'fp32 us':>8} "
          f"{'bound':>6} | {'floor us':>8} {'of floor':>8}")
    for m in (1, 2, 4, 8):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)

        def pair(i):
            w = ws[i % copies]
            return ops.nvfp4_fp32_linear_multi(x, [a for a, _ in w], [b for _, b in w], gs, fw[i % copies])

        reps = reps_for(wbytes, 0, 0)
        with kernel_overrides(beside=True):
            t_on = graph_us(pair, reps)
        t_off = graph_us(pair, reps)
        t_g = graph_us(lambda i: ops.nvfp4_linear_multi(x, [a for a, _ in ws[i % copies]],
                                                        [b for _, b in ws[i % copies]], gs), reps)
        t_f = graph_us(lambda i: ops.fp32_linear(x, fw[i % copies]), reps)
        floor = wbytes / HBM * 1e6
        print(f"{m:3d} | {t_on:9.2f} {t_off:9.2f} {t_off - t_on:6.2f} | {t_g:8.2f} {t_f:8.2f} {min(t_g, t_f):6.2f} | "
              f"{floor:8.2f} {floor / t_on:8.0%}", flush=True)
    del ws, fw
    torch.cuda.empty_cache()


class MoePeer:
    """bf16 per-expert loop for a fixed routing (the expert list and token indices are prepared up front)."""

    def __init__(self, w1, w2, w3, shared, ids, wts):
        self.w1, self.w2, self.w3, self.shared = w1, w2, w3, shared
        self.plan = []
        ids_cpu = ids.cpu()
        for e in torch.unique(ids_cpu).tolist():
            t_idx, j_idx = torch.where(ids_cpu == e)
            self.plan.append((e, t_idx.cuda(), wts[t_idx.cuda(), j_idx.cuda()].contiguous()))

    @staticmethod
    def _act(g, u, w=None):
        h = F.silu(g.float().clamp(max=10.0)) * u.float().clamp(-10.0, 10.0)
        return (h if w is None else h * w[:, None]).to(torch.bfloat16)

    def __call__(self, x):
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, idx, w in self.plan:
            xe = x.index_select(0, idx)
            h = self._act(xe @ self.w1[e].t(), xe @ self.w3[e].t(), w)
            y.index_add_(0, idx, (h @ self.w2[e].t()).float())
        if self.shared is not None:
            s1, s2, s3 = self.shared
            y += (self._act(x @ s1.t(), x @ s3.t()) @ s2.t()).float()
        return y.to(torch.bfloat16)


def bench_moe(gen):
    print(f"\n## nvfp4_moe: {E} experts, top-{TOPK}, d={D}, I={INTER} (routing uniform random), vs bf16 per-expert loop")
    hdr = (f"{'variant':>15} {'T':>4} {'experts':>7} | {'nvfp4 us':>9} {'GB/s':>7} {'HBM':>5} | "
           f"{'bf16 us':>9} {'bf16 GB/s':>9} {'speedup':>7}")
    print(hdr)
    print("-" * len(hdr))
    w13, s13 = rand_kernel_weight((E,), 2 * INTER, D, gen)
    w2, s2 = rand_kernel_weight((E,), D, INTER, gen)
    g13 = torch.full((E,), 0.01, device="cuda")
    g2 = torch.full((E,), 0.01, device="cuda")
    sw13, ss13 = rand_kernel_weight((), 2 * INTER, D, gen)
    sw2, ss2 = rand_kernel_weight((), D, INTER, gen)
    sg = torch.tensor(0.01, device="cuda")
    bw1 = torch.empty(E, INTER, D, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    bw3 = torch.empty(E, INTER, D, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    bw2 = torch.empty(E, D, INTER, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    bshared = tuple(t.normal_(0, 0.02, generator=gen) for t in (
        torch.empty(INTER, D, device="cuda", dtype=torch.bfloat16),
        torch.empty(D, INTER, device="cuda", dtype=torch.bfloat16),
        torch.empty(INTER, D, device="cuda", dtype=torch.bfloat16)))
    expert_bytes = nvfp4_bytes(2 * INTER, D) + nvfp4_bytes(D, INTER)
    rows = []
    for T in (1, 8, 16, 64, 512, 4096, 8192):  # 512 ... 8192: prefill chunks (the wgmma kernels)
        x = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(T, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
        wts = torch.rand(T, TOPK, device="cuda", generator=gen)
        n_unique = int(torch.unique(ids).numel())
        for variant in ("routed", "routed+shared"):
            sh = (sw13, ss13, sg, sw2, ss2, sg) if variant != "routed" else (None,) * 6
            nbytes = n_unique * expert_bytes + (expert_bytes if variant != "routed" else 0)
            reps = max(2, min(64, int(4e-3 / (nbytes / 3e12 + 10e-6))))
            t_op = graph_us(lambda i: ops.nvfp4_moe(x, ids, wts, w13, s13, g13, w2, s2, g2, *sh, 10.0), reps)
            peer = MoePeer(bw1, bw2, bw3, bshared if variant != "routed" else None, ids, wts)
            bbytes = (n_unique + (variant != "routed")) * 3 * INTER * D * 2
            t_peer = graph_us(lambda i: peer(x), 2 if T > 8 else 5)
            with kernel_choice("skinny"):  # the decode kernel before gemv
                t_gv = graph_us(lambda i: ops.nvfp4_moe(x, ids, wts, w13, s13, g13, w2, s2, g2, *sh, 10.0), reps)
            with kernel_choice("wgmma"):  # the warpgroup-MMA kernels where skinny would run (T*k > 4E)
                t_wg = graph_us(lambda i: ops.nvfp4_moe(x, ids, wts, w13, s13, g13, w2, s2, g2, *sh, 10.0), reps)
            with kernel_choice("wgmma_wide"):  # the same with 256-row tiles
                t_ww = graph_us(lambda i: ops.nvfp4_moe(x, ids, wts, w13, s13, g13, w2, s2, g2, *sh, 10.0), reps)
            rows2 = ""
            if 8 < T <= 64:  # the gemv kernel's 2-token passes (moe_gemv_rows; where gemv runs: else the same)
                with kernel_overrides(moe_gemv_rows=2):
                    t_r2 = graph_us(lambda i: ops.nvfp4_moe(x, ids, wts, w13, s13, g13, w2, s2, g2, *sh, 10.0), reps)
                rows2 = f" | 2-row gemv {t_r2:7.1f} us ({nbytes / (t_r2 * 1e-6) / HBM:4.0%})"
            gbs = nbytes / (t_op * 1e-6)
            print(f"{variant:>15} {T:>4} {n_unique:>7} | {t_op:9.1f} {gbs / 1e9:7.0f} {gbs / HBM:5.0%} | "
                  f"{t_peer:9.1f} {bbytes / (t_peer * 1e-6) / 1e9:9.0f} {t_peer / t_op:6.2f}x | "
                  f"skinny {t_gv:7.1f} us ({nbytes / (t_gv * 1e-6) / HBM:4.0%}) | wgmma {t_wg:7.1f} us "
                  f"({t_peer / t_wg:4.2f}x bf16) | wide {t_ww:7.1f} us ({t_peer / t_ww:4.2f}x bf16)" + rows2)
            rows.append((variant, T, n_unique, t_op, t_peer))
    return rows


def bench_head(gen):
    """The head as the model runs it (V4-Flash: 129280 x 4096; fp32 logits): stored bf16 through dsv4::fp32_linear
    (exact products, fp32 sums) against the NVFP4 head of head_quant="nvfp4" (dsv4::nvfp4_linear, out_dtype fp32).
    Then the built-in model's head (4096 x 256), where the NVFP4 drafters' head measured slower per step."""
    for n, k, ms in ((129280, 4096, (1, 8, 64, 256)), (4096, 256, (1, 4, 8))):
        _bench_head(gen, n, k, ms)


def _bench_head(gen, n, k, ms):
    print(f"\n## the head, {n} x {k}, fp32 logits: bf16 weight (dsv4::fp32_linear, the default) vs NVFP4 "
          "(head_quant: dsv4::nvfp4_linear out_dtype=fp32)")
    hdr = f"{'M':>5} | {'bf16 us':>9} {'HBM':>5} | {'nvfp4 us':>9} {'HBM':>5} | {'speedup':>7}"
    print(hdr + "\n" + "-" * len(hdr))
    wb = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)  # 1.06 GB: one copy streams from HBM
    wq, sq = rand_kernel_weight((), n, k, gen)
    gs = torch.tensor(0.01, device="cuda")
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        t_b = graph_us(lambda i: ops.fp32_linear(x, [wb]), 4)
        t_q = graph_us(lambda i: ops.nvfp4_linear(x, wq, sq, gs, torch.float32), 4)
        print(f"{m:5d} | {t_b:9.1f} {n * k * 2 / (t_b * 1e-6) / HBM:5.0%} | {t_q:9.1f} "
              f"{nvfp4_bytes(n, k) / (t_q * 1e-6) / HBM:5.0%} | {t_b / t_q:6.2f}x", flush=True)


def main():
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    parts = os.environ.get("BENCH_NVFP4_PARTS", "linear,grouped,multi,beside,moe,head").split(",")
    for name, fn in (("linear", bench_linear), ("grouped", bench_grouped), ("multi", bench_multi),
                     ("beside", bench_beside), ("moe", bench_moe), ("head", bench_head)):
        if name in parts:
            fn(gen)
            torch.cuda.empty_cache()
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
