"""NVFP4 GEMM / MoE references (dsv4::nvfp4_linear, nvfp4_linear_w4a4, nvfp4_moe, nvfp4_moe_rows)."""
import torch

from .nvfp4_quant import nvfp4_dequantize_ref

# ======================================================================================================
# NVFP4 GEMM / MoE: dsv4::nvfp4_linear, nvfp4_linear_w4a4, nvfp4_moe, nvfp4_moe_rows
# ======================================================================================================
# These take the CANONICAL NVFP4 layout (ModelOpt): codes uint8 [..., N, K/2] (element 2i in the low nibble),
# float8_e4m3fn block scales [..., N, K/16], fp32 dequant-direction global scale; value = e2m1 * scale * gs.
# The ops take the kernel layout of dsv4_model.quant.nvfp4.repack_weight; tests feed both from the same tensors.

def nvfp4_gemm_dequant_ref(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [..., N, K] weights via nvfp4_dequantize_ref; global_scale 0-d, or one per matrix (e.g. [E] for
    stacked [E, N, K/2])."""
    gs = global_scale.to(torch.float32)
    if gs.dim() > 0:
        gs = gs.reshape(gs.shape + (1,) * (packed.dim() - 1 - gs.dim())).expand(packed.shape[:-1])
    return nvfp4_dequantize_ref(packed, block_scale, gs, torch.float32)


def nvfp4_linear_ref(x, w_packed, w_scale, w_global_scale) -> torch.Tensor:
    """W4A16: bf16(x.float() @ W^T), fp32 accumulation."""
    w = nvfp4_gemm_dequant_ref(w_packed, w_scale, w_global_scale)
    return (x.float() @ w.t()).to(torch.bfloat16)


def nvfp4_linear_grouped_ref(x, w_packed, w_scale, w_global_scale) -> torch.Tensor:
    """x [..., G, K], G stacked matrices, global scales [G]: out[..., g, :] = nvfp4_linear_ref(x[..., g, :], W_g)."""
    return torch.stack([nvfp4_linear_ref(x[..., g, :], w_packed[g], w_scale[g], w_global_scale[g])
                        for g in range(x.shape[-2])], dim=-2)


def nvfp4_linear_w4a4_ref(x_packed, x_scale, x_global_scale, w_packed, w_scale, w_global_scale,
                          out_dtype=torch.bfloat16) -> torch.Tensor:
    """W4A4 (Blackwell NVFP4 GEMM numerics): both operands dequantized exactly, fp32 accumulation."""
    xd = nvfp4_gemm_dequant_ref(x_packed, x_scale, x_global_scale)
    w = nvfp4_gemm_dequant_ref(w_packed, w_scale, w_global_scale)
    return (xd @ w.t()).to(out_dtype)


def _row_products(x, w):
    """x [M, K] @ w [N, K]^T in fp32 one row at a time, as the CPU kernels sum (dsv4_ops/csrc/row_matmul.h): the
    bit-for-bit MoE checks need the same order, which a matmul of M rows does not promise."""
    if x.device.type != "cpu":
        return x @ w.t()
    return torch.stack([torch.mv(w, r) for r in x]) if len(x) else x.new_zeros(0, w.shape[0])


def _moe_expert_ref(x, w13, w2, route, limit):
    """bf16(W2 . bf16(swiglu(bf16(Wg x), bf16(Wu x)) [* route])); w13 fp32 [2I, d] = [gate; up], w2 fp32 [d, I]."""
    gate_w, up_w = w13.chunk(2, dim=0)
    g = _row_products(x.float(), gate_w.contiguous()).to(torch.bfloat16).float()
    u = _row_products(x.float(), up_w.contiguous()).to(torch.bfloat16).float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = torch.nn.functional.silu(g) * u
    if route is not None:
        h = h * route[:, None]
    return _row_products(h.to(torch.bfloat16).float(), w2).to(torch.bfloat16)


def nvfp4_moe_rows_ref(x, topk_ids, topk_weights, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, shared=None,
                       swiglu_limit=10.0) -> torch.Tensor:
    """dsv4::nvfp4_moe_rows: each assignment's expert output (bf16) before the combine, [T*k + T*has_shared, d].
    Row t*k + j = o[t, j] = the output of expert topk_ids[t, j] for token t, routing weight applied (zeros where the
    id is outside [0, E)); row T*k + t = the shared expert's output for token t. Arguments as nvfp4_moe_ref."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    ids = topk_ids.long()
    outs = torch.zeros(T, k, x.shape[1], dtype=torch.bfloat16, device=x.device)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < E:
            continue
        t_idx, j_idx = torch.where(ids == e)
        w13_e = nvfp4_gemm_dequant_ref(w13[e], w13_scale[e], w13_gs[e])
        w2_e = nvfp4_gemm_dequant_ref(w2[e], w2_scale[e], w2_gs[e])
        outs[t_idx, j_idx] = _moe_expert_ref(x[t_idx], w13_e, w2_e, topk_weights[t_idx, j_idx].float(), swiglu_limit)
    rows = [outs.reshape(T * k, x.shape[1])]
    if shared is not None:
        sw13, ss13, sg13, sw2, ss2, sg2 = shared
        rows.append(_moe_expert_ref(x, nvfp4_gemm_dequant_ref(sw13, ss13, sg13),
                                    nvfp4_gemm_dequant_ref(sw2, ss2, sg2), None, swiglu_limit))
    return torch.cat(rows)


def moe_combine_rows_ref(rows: torch.Tensor, ids: torch.Tensor, n_experts: int, has_shared: bool) -> torch.Tensor:
    """The MoE combine of nvfp4_moe_rows' layout: [T, d] in rows' dtype (the op's: bf16) = the fp32 sum_j
    fp32(rows[t*k + j]) over the slots with 0 <= ids[t, j] < n_experts, in j order, then + fp32(rows[T*k + t]) when
    has_shared, rounded once; ids [T, k]. The values in rows of other ids do not matter (the CUDA op leaves them
    unwritten: NaN / Inf garbage is masked out)."""
    T, k = ids.shape
    d = rows.shape[-1]
    assert rows.shape == (T * k + (T if has_shared else 0), d), (tuple(rows.shape), T, k, has_shared)
    local = (ids >= 0) & (ids < n_experts)
    routed = rows[:T * k].reshape(T, k, d).float()
    acc = torch.zeros(T, d, dtype=torch.float32, device=rows.device)
    for j in range(k):
        # a skipped slot adds +0: the running sum starts at +0 and is never -0, so no bit changes
        acc = acc + torch.where(local[:, j, None], routed[:, j], 0.0)
    if has_shared:
        acc = acc + rows[T * k:].float()
    return acc.to(rows.dtype)


def nvfp4_moe_ref(x, topk_ids, topk_weights, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, shared=None,
                  swiglu_limit=10.0) -> torch.Tensor:
    """Routed (+ shared) SwiGLU experts, DeepSeek-V4 order. x bf16 [T, d]; w13 canonical [E, 2I, d/2] with the
    gate rows first; shared = (w13 [2Is, d/2], s13, gs13, w2 [d, Is/2], s2, gs2) or None.
    y = bf16(sum_j fp32(o[t, j]) + fp32(o_shared[t])) summed in slot order, o = the expert's bf16 output;
    assignments whose expert id is outside [0, E) contribute 0."""
    rows = nvfp4_moe_rows_ref(x, topk_ids, topk_weights, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, shared,
                              swiglu_limit)
    return moe_combine_rows_ref(rows, topk_ids, w13.shape[0], shared is not None)
