"""DeepSeek-V4 attention: shared K=V MQA over a sliding window plus compressed entries (CSA / HCA).

Shapes: B batch, S tokens, H heads, D head_dim (last `rd` dims carry RoPE), W window, m compress ratio.

Per-layer cache (non-persistent buffers, allocated by `alloc_runtime`):
  kv_cache [max_batch, W + max_seq_len // m, D]: slots 0..W-1 a ring (token p at p % W), slot W+i = entry i.
  compressor kv_state / score_state fp32 [max_batch, c*m, c*Dc] (c = 2 for the overlapping ratio-4 compressor).
  indexer kv_cache [max_batch, max_seq_len // m, index_head_dim] (FP4-rounded keys in the model dtype), and the
  same keys as DeepSeek's FP4 indexer cache: k_codes uint8 [.., index_head_dim / 2] + k_scales uint8 (UE8M0 per
  32) [.., index_head_dim / 32], 68 bytes per 128-dim key, which decode scores with dsv4::indexer_score_topk.
Validity is derived from positions only (ring slot s valid iff s <= p; entry i valid iff i < (p+1)//m), so rows
never need clearing between sequences; prefill rewrites every compressor state row.

Indexer top-k order (documented choice): higher score first, equal scores -> lower entry index, -0.0 == +0.0.
Only the selected SET matters to attention; this makes it deterministic across devices.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_ops.reference import indexer_fp4_quantize_keys

from .config import ModelConfig
from .layers import Linear, RMSNorm, apply_rope, fp32_linear, fused_on, unweighted_rms_norm
from .quant_sim import indexer_fake_quant, kv_fake_quant


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest fp32 scores along the last dim; ties -> lower index (static shapes)."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores).float().contiguous()
    bits = s.view(torch.int32)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    n = scores.shape[-1]
    idx = torch.arange(n, device=scores.device, dtype=torch.int64)
    # (n - 1 - idx), not (2**32 - 1 - idx): Inductor's Triton codegen keeps index constants in int32.
    key = key * 4294967296 + ((n - 1) - idx)
    return key.topk(k, dim=-1).indices


def decode_rope(table: torch.Tensor, slots: tuple[torch.Tensor, list[int]] | None = None,
                nvis_slots: tuple[torch.Tensor, list[int]] | None = None, attn_slots: dict | None = None) -> dict:
    """A decode step's view of one RoPE table: the rows it reads, gathered once per step and offset and shared
    by every layer using the table (one gather kernel per step instead of one per layer and use), the step's
    attended row list of the layers without an indexer, and the visible compressed entries per ratio. slots:
    (buffer [n, max_batch, rope_dim / 2, 2], the offsets m of its n slots): rows of those offsets are written
    there (see Transformer.setup_runtime for why); nvis_slots: (int64 buffer [n, max_batch], the ratios) the
    same for visible_entries; attn_slots: {(window, ratio, entries): int32 buffer [1, max_batch, J]} the same
    for the attended rows."""
    return {"table": table, "rows": {}, "attn_rows": {}, "slots": slots, "n_vis": {}, "nvis_slots": nvis_slots,
            "attn_slots": attn_slots or {}}


def _in_slot(slots, key, value: torch.Tensor) -> torch.Tensor:
    """value written into its slot of a step's scratch buffer (and that slot returned), where there is one."""
    if slots is None or key not in slots[1] or slots[0].dtype != value.dtype:
        return value
    out = slots[0][slots[1].index(key), :value.shape[0]]
    out.copy_(value)
    return out


def rope_rows(rope: dict, positions: torch.Tensor, m: int = 1) -> torch.Tensor:
    """table[(positions + 1 - m).clamp(min=0)]: the token's own row (m = 1) or the first row of the m-token window
    it closes; cached in the step's rope dict (the positions are the step's)."""
    rows = rope["rows"]
    if m not in rows:
        rows[m] = _in_slot(rope.get("slots"), m, rope["table"][(positions + 1 - m).clamp(min=0)])
    return rows[m]


def visible_entries(rope: dict, positions: torch.Tensor, m: int) -> torch.Tensor:
    """(positions + 1) // m, the compressed entries a decode token sees; once per step and ratio (in the step's
    scratch slot where there is one: a plain value would be recomputed by Inductor for each op reading it)."""
    vis = rope.setdefault("n_vis", {})
    if m not in vis:
        vis[m] = _in_slot(rope.get("nvis_slots"), m, (positions + 1) // m)
    return vis[m]


def _fused_compressor() -> bool:
    """Decode updates a compressor's state and pools its window with one dsv4::compressor_decode call (one
    launch instead of ~6 kernels). On unless DSV4_FUSED_COMPRESSOR=0. Read when the step is
    traced."""
    return fused_on("DSV4_FUSED_COMPRESSOR")


def _fused_hadamard(x: torch.Tensor) -> bool:
    """Decode's indexer queries (RoPE + Hadamard + FP4) and keys (Hadamard + FP4) as one dsv4::hadamard_fp4 call
    each, instead of a RoPE kernel, an fp32 GEMM with its reduction and two FP4 kernels. Same bits as the tensor
    ops (quant_sim.hadamard_rotate is the same butterfly). Where the op takes the shape, on unless
    DSV4_FUSED_HADAMARD=0. Read when the step is traced."""
    d = x.shape[-1]
    if x.dtype not in (torch.bfloat16, torch.float32) or d not in (64, 128, 256):
        return False
    return fused_on("DSV4_FUSED_HADAMARD")


def _fused_sel_rows() -> bool:
    """A CSA layer hands dsv4::sparse_attn_decode the step's window rows (shared by the layers) and its indexer's
    top-k as they are (the op's idx2 at offset window) instead of a joined row list built per layer (an Inductor
    kernel per CSA layer). Off unless DSV4_FUSED_SEL_ROWS=1 until timed on the GPU. Read when the step is
    traced."""
    return os.environ.get("DSV4_FUSED_SEL_ROWS", "0") == "1"


def _fused_key_store(keys: torch.Tensor) -> bool:
    """Decode writes a closed window's indexer key into the float and the packed FP4 caches with one
    dsv4::indexer_store_keys call (instead of the packing kernels and three index_put kernels).
    Where the op takes the shape, on unless DSV4_FUSED_KEY_STORE=0. Read when the step is traced."""
    if keys.dtype not in (torch.bfloat16, torch.float32) or keys.shape[-1] not in (64, 128, 256, 512):
        return False
    return fused_on("DSV4_FUSED_KEY_STORE")


def _fused_norm_rope(x: torch.Tensor, rope_dim: int) -> bool:
    """Decode normalises and rotates q / kv / compressed entries [B, H, D] with one dsv4::rms_norm_rope call
    (with the simulated FP8 rounding of kv) instead of 2-3 Inductor kernels each. Where the op takes the
    shape, on unless DSV4_FUSED_NORM_ROPE=0. Read when the step is traced."""
    d = x.shape[-1]
    if x.dtype not in (torch.bfloat16, torch.float32) or d % 4 or rope_dim % 4 or d > 4096:
        return False
    return fused_on("DSV4_FUSED_NORM_ROPE")


def _fused_store(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """Decode writes its normalised kv / compressed entry straight into the attention cache with
    dsv4::rms_norm_rope_store (the index_put kernels and the read of the old entry go). Where the op takes the
    cache, on unless DSV4_FUSED_NORM_ROPE_STORE=0. Read when the step is traced."""
    return cache.dtype == x.dtype and cache.is_contiguous() and fused_on("DSV4_FUSED_NORM_ROPE_STORE")


class Compressor(nn.Module):
    """Gated pooling of m consecutive tokens into one entry (overlapping 2m-token windows when m == 4)."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, rotate: bool, max_batch: int):
        super().__init__()
        self.ratio = ratio
        self.overlap = ratio == 4
        self.coff = 2 if self.overlap else 1
        self.head_dim = head_dim
        self.rope_dim = cfg.rope_head_dim
        self.rotate = rotate  # indexer keys: Hadamard + FP4 instead of FP8 nope dims
        self.max_batch = max_batch
        self.simulate_quant = True
        c = self.coff
        self.ape = nn.Parameter(torch.empty(ratio, c * head_dim, dtype=torch.float32), requires_grad=False)
        # checkpoint stores bf16; official runs the compressor projections in fp32
        self.wkv = Linear(cfg.dim, c * head_dim, torch.float32)
        self.wgate = Linear(cfg.dim, c * head_dim, torch.float32)
        self.norm = RMSNorm(head_dim, cfg.norm_eps)

    def alloc_runtime(self, device) -> None:
        c, m = self.coff, self.ratio
        shape = (self.max_batch, c * m, c * self.head_dim)
        self.register_buffer("kv_state", torch.zeros(shape, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("score_state", torch.full(shape, float("-inf"), dtype=torch.float32, device=device),
                             persistent=False)

    @torch.no_grad()
    def narrow_weights_(self) -> None:
        """Keep wkv / wgate in bf16 when that is lossless (the released checkpoints store them in bf16): decode
        reads half the bytes, and dsv4::fp32_linear widens them exactly, so every result is unchanged. Weights
        with values bf16 cannot hold (e.g. trained or randomised in fp32) stay fp32. Call once the weights are
        in place (Transformer.narrow_weights_): anything copied in later would be rounded to bf16."""
        for lin in (self.wkv, self.wgate):
            w = lin.weight
            if w.dtype != torch.float32 or w.device.type == "meta" or w.requires_grad:
                continue
            narrow = w.to(torch.bfloat16)
            if torch.equal(narrow.float(), w):
                lin.weight = nn.Parameter(narrow, requires_grad=False)

    def reset_state(self) -> None:
        self.kv_state.zero_()
        self.score_state.fill_(float("-inf"))

    def _finish(self, pooled: torch.Tensor, cs: torch.Tensor, dtype: torch.dtype, store=None) -> torch.Tensor | None:
        """Pooled entries -> cache entries: RMSNorm, RoPE, and the simulated FP8 (KV) or Hadamard + FP4 (indexer
        keys) rounding; at decode (one entry per row) through the fused ops where they are on. store: (positions,
        cache, offset) at decode: the entry is written into cache where its window closed (returns None) when the
        fused op can; else returned for the caller to write."""
        decode, x = pooled.dim() == 2, pooled.to(dtype)
        if decode and _fused_norm_rope(x, self.rope_dim):
            fp8 = self.simulate_quant and not self.rotate
            index_keys = self.simulate_quant and self.rotate  # then the Hadamard + FP4 rounding follows
            if not index_keys and store is not None and _fused_store(x, store[1]):
                positions, cache, offset = store
                torch.ops.dsv4.rms_norm_rope_store(x, self.norm.weight, cs, self.norm.eps, self.rope_dim, fp8,
                                                   positions, self.ratio, offset, cache.shape[1] - offset, cache)
                return None
            kv = torch.ops.dsv4.rms_norm_rope(x.unsqueeze(1), self.norm.weight, cs, self.norm.eps, self.rope_dim,
                                              fp8).squeeze(1)
            if not index_keys:
                return kv
        else:
            kv = apply_rope(self.norm(x), cs, self.rope_dim)
            if not self.simulate_quant:
                return kv
            if not self.rotate:
                return kv_fake_quant(kv, self.rope_dim)
        if decode and _fused_hadamard(kv):
            return torch.ops.dsv4.hadamard_fp4(kv.unsqueeze(1), None, 0).squeeze(1)
        return indexer_fake_quant(kv)

    def linears(self) -> list[torch.Tensor]:
        return [self.wkv.weight, self.wgate.weight]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv, score = fp32_linear(x, self.linears())
        return kv, score

    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, rope: torch.Tensor) -> torch.Tensor | None:
        """x [B, S, dim] from position 0; rows valid up to lengths[b]. Returns entries [B, S//m, Dc] (or None)
        and sets the decode state of rows [:B] from each row's own length."""
        B, S, _ = x.shape
        m, c, hd = self.ratio, self.coff, self.head_dim
        kv, score = self._project(x)
        t = torch.arange(S, device=x.device)
        score = score + self.ape[t % m]

        # decode state: overlap rows 0..m-1 = last full window, rows m.. (or 0.. w/o overlap) = pending tail
        n_full = (lengths // m).unsqueeze(1)  # [B, 1]
        r = torch.arange(c * m, device=x.device).unsqueeze(0)
        if self.overlap:
            p = torch.where(r < m, m * (n_full - 1) + r, m * n_full + (r - m))
            valid = torch.where(r < m, n_full >= 1, p < lengths.unsqueeze(1))
        else:
            p = m * n_full + r
            valid = p < lengths.unsqueeze(1)
        gi = p.clamp(0, S - 1).unsqueeze(-1).expand(-1, -1, c * hd)
        vmask = valid.unsqueeze(-1)
        self.kv_state[:B] = torch.where(vmask, kv.gather(1, gi), torch.zeros((), device=x.device))
        self.score_state[:B] = torch.where(vmask, score.gather(1, gi), torch.full((), float("-inf"), device=x.device))

        n = S // m
        if n == 0:
            return None
        kvw = kv[:, : n * m].view(B, n, m, c * hd)
        scw = score[:, : n * m].view(B, n, m, c * hd)
        if self.overlap:
            prev_kv = F.pad(kvw[:, :-1, :, :hd], (0, 0, 0, 0, 1, 0), value=0.0)
            prev_sc = F.pad(scw[:, :-1, :, :hd], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            kvw = torch.cat([prev_kv, kvw[..., hd:]], dim=2)
            scw = torch.cat([prev_sc, scw[..., hd:]], dim=2)
        pooled = (kvw * scw.softmax(dim=2)).sum(dim=2)  # [B, n, Dc] fp32
        cs = rope[torch.arange(n, device=x.device) * m]
        return self._finish(pooled, cs, x.dtype)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, rope: dict,
               proj: tuple[torch.Tensor, torch.Tensor] | None = None, store=None):
        """x [B, dim] = token at positions[b]; rope: the step's decode_rope. Updates state rows [:B]; returns
        (entry [B, Dc] for window positions//m, complete [B] bool: whether that window closed at this token). proj:
        (wkv(x), wgate(x)) if already computed (Attention runs both compressors' projections in one launch).
        store: (positions, cache, offset): entry is None when it was written into cache already (_finish)."""
        B = x.shape[0]
        m, hd = self.ratio, self.head_dim
        kv, score = self._project(x) if proj is None else proj
        cs = rope_rows(rope, positions, m)
        complete = (positions + 1) % m == 0
        if _fused_compressor():
            # the op rounds the pooling to x's dtype itself (_finish's .to(dtype) is then no kernel)
            dt = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
            pooled = torch.empty(B, hd, dtype=dt, device=x.device)
            torch.ops.dsv4.compressor_decode(kv, score, self.ape, positions, self.kv_state, self.score_state, pooled)
            return self._finish(pooled, cs, x.dtype, store), complete
        rows = torch.arange(B, device=x.device)
        score = score + self.ape[positions % m]
        slot = (self.coff - 1) * m + positions % m
        self.kv_state.index_put_((rows, slot), kv)
        self.score_state.index_put_((rows, slot), score)
        if self.overlap:
            kv_s = torch.cat([self.kv_state[:B, :m, :hd], self.kv_state[:B, m:, hd:]], dim=1)
            sc_s = torch.cat([self.score_state[:B, :m, :hd], self.score_state[:B, m:, hd:]], dim=1)
            pooled = (kv_s * sc_s.softmax(dim=1)).sum(dim=1)
            cm = complete.view(B, 1, 1)
            new_prev_kv = torch.where(cm, self.kv_state[:B, m:], self.kv_state[:B, :m])
            new_prev_sc = torch.where(cm, self.score_state[:B, m:], self.score_state[:B, :m])
            self.kv_state[:B, :m] = new_prev_kv
            self.score_state[:B, :m] = new_prev_sc
        else:
            pooled = (self.kv_state[:B] * self.score_state[:B].softmax(dim=1)).sum(dim=1)
        return self._finish(pooled, cs, x.dtype, store), complete


# The op's CUDA partial kernels: tensor cores (bf16, head dim % 64 == 0, <= 512) beat the tensor-op form at
# every measured size (H200, 64 heads x 512, bench_attn_decode.py: 640 rows at batch 1 / 8 / 32 15.4 / 26.0 /
# 67.5 us vs 28.2 / 58.0 / 127.2 us). The CUDA-core kernel (fp32, or DSV4_ATTN_KERNEL=simt) wins only while
# batch x listed rows <= FUSED_ATTN_MAX_ROWS (640 rows: 23.3 / 46.4 / 71.8 us at batch 1 / 4 / 8 vs 28.2 / 48.5 /
# 58.0 us).
FUSED_ATTN_MAX_ROWS = 4 * 640


def _attn_tensor_cores(q: torch.Tensor) -> bool:
    """Whether dsv4::sparse_attn_decode runs its tensor-core partial kernel for q (the CUDA binding's rule)."""
    return (q.dtype == torch.bfloat16 and q.shape[-1] % 64 == 0 and q.shape[-1] <= 512
            and os.environ.get("DSV4_ATTN_KERNEL", "") != "simt")


def _fused_decode_attention(batch: int, rows: int, q: torch.Tensor) -> bool:
    """Decode attends with dsv4::sparse_attn_decode (one op instead of a gather, two GEMMs per key set, masks and
    a softmax) where it is faster: with its tensor-core kernel always, else while batch * rows <=
    FUSED_ATTN_MAX_ROWS. DSV4_DECODE_ATTENTION=torch keeps the tensor-op form (_attend), =fused the op at every
    size; read when the step is traced (shapes are static there)."""
    mode = os.environ.get("DSV4_DECODE_ATTENTION", "auto")
    if mode == "torch":
        return False
    return mode == "fused" or _attn_tensor_cores(q) or batch * rows <= FUSED_ATTN_MAX_ROWS


def _w4a16(mod: nn.Module) -> bool:
    """A W4A16 NVFP4 projection (dsv4_model.quantize_model.Nvfp4ModelLinear; not imported: it imports this)."""
    return getattr(mod, "w4a4", True) is False and hasattr(mod, "out_dtype") and hasattr(mod, "weight_packed")


def _multi(x: torch.Tensor, mods) -> tuple[torch.Tensor, ...]:
    """The W4A16 projections `mods` of the same x in one dsv4::nvfp4_linear_multi call (the values of
    calling each module)."""
    outs = torch.ops.dsv4.nvfp4_linear_multi(x.to(torch.bfloat16), [m.weight_packed for m in mods],
                                             [m.weight_scale for m in mods], [m.weight_global_scale for m in mods])
    return tuple(o.to(m.out_dtype) for o, m in zip(outs, mods))


class Indexer(nn.Module):
    """Lightning indexer: score(t, i) = sum_h w[t,h] * relu(qI[t,h] . kI[i]); keeps the top index_topk entries."""

    def __init__(self, cfg: ModelConfig, ratio: int, dtype: torch.dtype, max_batch: int, max_seq_len: int):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.rope_head_dim
        self.index_topk = cfg.index_topk
        self.ratio = ratio
        self.max_batch = max_batch
        self.n_entries = max_seq_len // ratio
        self.simulate_quant = True
        self.packed = True  # False: decode scores the float cache with PyTorch ops (the reference path)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.weights_proj = Linear(cfg.dim, self.n_heads, dtype)
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.compressor = Compressor(cfg, ratio, self.head_dim, True, max_batch)

    def alloc_runtime(self, device, dtype: torch.dtype) -> None:
        self.register_buffer("kv_cache", torch.zeros(self.max_batch, self.n_entries, self.head_dim, dtype=dtype,
                                                     device=device), persistent=False)
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("k_codes", torch.zeros(self.max_batch, self.n_entries, self.head_dim // 2, **u8),
                             persistent=False)
        self.register_buffer("k_scales", torch.zeros(self.max_batch, self.n_entries, self.head_dim // 32, **u8),
                             persistent=False)

    def queries(self, qr: torch.Tensor, cs: torch.Tensor, proj: torch.Tensor | None = None) -> torch.Tensor:
        """qr [..., q_lora] -> [..., H_I, Di]; cs broadcastable to the head axis. proj: wq_b(qr) if already
        computed (Attention runs it in the same launch as its own wq_b)."""
        q = (self.wq_b(qr) if proj is None else proj).unflatten(-1, (self.n_heads, self.head_dim))
        if q.dim() == 3 and self.simulate_quant and _fused_hadamard(q):  # decode: cs [B, 1, rope_dim / 2, 2]
            return torch.ops.dsv4.hadamard_fp4(q, cs.reshape(q.shape[0], self.rope_dim // 2, 2), self.rope_dim)
        q = apply_rope(q, cs, self.rope_dim)
        if self.simulate_quant:
            q = indexer_fake_quant(q)
        return q

    def packed_decode(self) -> bool:
        """Decode scores the packed FP4 cache with dsv4::indexer_score_topk: the keys are FP4 (simulate_quant)
        and the kernel takes the shape (CUDA: D = 128, H <= 64, top-k <= 4096; the CPU kernel: any D % 32 == 0).
        Both paths select the same entries up to fp32 summation order."""
        if not (self.simulate_quant and self.packed):
            return False
        if self.kv_cache.device.type == "cuda":
            return self.head_dim == 128 and self.n_heads <= 64 and min(self.index_topk, self.n_entries) <= 4096
        return self.kv_cache.device.type == "cpu"

    def store_prefill(self, keys: torch.Tensor) -> None:
        """keys [B, n, Di] (FP4-rounded) -> entries [0, n) of rows [:B] of both caches."""
        B, n = keys.shape[:2]
        self.kv_cache[:B, :n] = keys
        if self.packed_decode():  # FP4 values: the packed form is exact
            codes, scales = indexer_fp4_quantize_keys(keys)
            self.k_codes[:B, :n] = codes
            self.k_scales[:B, :n] = scales

    def select(self, q: torch.Tensor, x: torch.Tensor, n_vis: torch.Tensor, k: int,
               proj: torch.Tensor | None = None) -> torch.Tensor:
        """Decode top-k over the packed cache: q [B, H_I, Di], x [B, dim], n_vis [B] -> int32 [B, k], -1 past
        the valid entries. proj: weights_proj(x) if already computed (Attention._fp32_projections)."""
        B = q.shape[0]
        w = (self.weights_proj(x) if proj is None else proj).float() * self.weight_scale
        return torch.ops.dsv4.indexer_score_topk(q, w, self.k_codes[:B], self.k_scales[:B], n_vis, k)

    def scores(self, q: torch.Tensor, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [B, S, H_I, Di], x [B, S, dim], keys [B, T, Di] -> fp32 [B, S, T]."""
        w = self.weights_proj(x).float() * self.weight_scale
        s = torch.einsum("bshd,btd->bsht", q.float(), keys.float()).relu()
        return (s * w.unsqueeze(-1)).sum(dim=2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, max_batch: int, max_seq_len: int):
        super().__init__()
        self.ratio = cfg.layer_ratio(layer_id)
        self.n_heads, self.head_dim, self.rope_dim = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.window = cfg.window_size
        self.eps = cfg.norm_eps
        self.n_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.max_batch = max_batch
        self.n_entries = max_seq_len // self.ratio if self.ratio else 0
        self.softmax_scale = self.head_dim**-0.5
        self.rope_kind = "compress" if self.ratio else "main"
        self.simulate_quant = True
        self.prefill_chunk = 512
        # CSA prefill: dense mask over all entries up to this many, else gather the top-k entries per query
        self.prefill_dense_max_entries = 2048
        H, D = self.n_heads, self.head_dim
        self.attn_sink = nn.Parameter(torch.empty(H, dtype=torch.float32), requires_grad=False)
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * D, dtype)
        self.wkv = Linear(cfg.dim, D, dtype)
        self.kv_norm = RMSNorm(D, cfg.norm_eps)
        self.wo_a = Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dtype)
        self.compressor = Compressor(cfg, self.ratio, D, False, max_batch) if self.ratio else None
        self.indexer = Indexer(cfg, self.ratio, dtype, max_batch, max_seq_len) if self.ratio == 4 else None

    def alloc_runtime(self, device, dtype: torch.dtype) -> None:
        self.register_buffer("kv_cache", torch.zeros(self.max_batch, self.window + self.n_entries, self.head_dim,
                                                     dtype=dtype, device=device), persistent=False)

    # ------------------------------------------------------------------ shared pieces
    def _qkv(self, x: torch.Tensor, cs: torch.Tensor, index_proj: bool = False,
             positions: torch.Tensor | None = None):
        """x [..., dim] -> (qr [..., q_lora], q [..., H, D], kv [..., D], iproj); cs: rope rows for x's positions.
        iproj: the indexer's wq_b(qr) when index_proj and it ran in the same launch as wq_b (else None).
        positions (decode): kv may go straight into the window of kv_cache at positions % window (then None)."""
        qa, kva = self._x_projections(x)
        if qa.dim() == 2 and _fused_norm_rope(qa, 0):  # decode: a dsv4 kernel (PDL) instead of Inductor's reduction
            cs0 = qa.new_empty((qa.shape[0], 0, 2), dtype=torch.float32)
            qr = torch.ops.dsv4.rms_norm_rope(qa.unsqueeze(1), self.q_norm.weight, cs0, self.q_norm.eps, 0,
                                              False).squeeze(1)
        else:
            qr = self.q_norm(qa)
        qb, iproj = self._qr_projections(qr, index_proj)
        q = qb.unflatten(-1, (self.n_heads, self.head_dim))
        if q.dim() == 3 and _fused_norm_rope(q, self.rope_dim):  # decode: x [B, dim], cs [B, rope_dim / 2, 2]
            q = torch.ops.dsv4.rms_norm_rope(q, None, cs, self.eps, self.rope_dim, False)
            if positions is not None and _fused_store(kva, self.kv_cache):
                torch.ops.dsv4.rms_norm_rope_store(kva, self.kv_norm.weight, cs, self.kv_norm.eps, self.rope_dim,
                                                   self.simulate_quant, positions, 0, 0, self.window, self.kv_cache)
                return qr, q, None, iproj
            kv = torch.ops.dsv4.rms_norm_rope(kva.unsqueeze(1), self.kv_norm.weight, cs, self.kv_norm.eps,
                                              self.rope_dim, self.simulate_quant).squeeze(1)
            return qr, q, kv, iproj
        q = apply_rope(unweighted_rms_norm(q, self.eps), cs.unsqueeze(-3), self.rope_dim)
        kv = apply_rope(self.kv_norm(kva), cs, self.rope_dim)
        if self.simulate_quant:
            kv = kv_fake_quant(kv, self.rope_dim)
        return qr, q, kv, iproj

    def _x_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(wq_a(x), wkv(x)); one dsv4::nvfp4_linear_multi launch when both are W4A16 NVFP4 (the same numerics as
        two nvfp4_linear calls)."""
        if _w4a16(self.wq_a) and _w4a16(self.wkv):
            return _multi(x, (self.wq_a, self.wkv))
        return self.wq_a(x), self.wkv(x)

    def _qr_projections(self, qr: torch.Tensor, index_proj: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(wq_b(qr), the indexer's wq_b(qr) or None); both in one launch when asked for and both are W4A16."""
        if index_proj and self.indexer is not None and _w4a16(self.wq_b) and _w4a16(self.indexer.wq_b):
            return _multi(qr, (self.wq_b, self.indexer.wq_b))
        return self.wq_b(qr), None

    def _fp32_projections(self, x: torch.Tensor):
        """The fp32-math projections of x at decode, in one dsv4::fp32_linear call: ((wkv(x), wgate(x)) of the
        compressor or None, the same of the indexer's compressor or None, the indexer's weights_proj(x) (rounded
        to its weight's dtype, as the module returns it) or None)."""
        ix = self.indexer
        comp, icomp = self.compressor, (ix.compressor if ix is not None else None)
        wp = ix.weights_proj.weight if (ix is not None and ix.packed_decode()
                                        and type(ix.weights_proj) is Linear) else None
        ws = [w for c in (comp, icomp) if c is not None for w in c.linears()] + ([wp] if wp is not None else [])
        if not ws:
            return None, None, None
        outs = iter(fp32_linear(x, ws))
        cproj = (next(outs), next(outs)) if comp is not None else None
        iproj = (next(outs), next(outs)) if icomp is not None else None
        return cproj, iproj, (next(outs).to(wp.dtype) if wp is not None else None)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, qkeys: torch.Tensor | None = None,
                qmask: torch.Tensor | None = None) -> torch.Tensor:
        """One softmax (fp32, with the per-head sink in the denominator) over the union of
        shared keys [B, J, D] (mask [B, T, J]) and optional per-query keys [B, T, K, D] (qmask [B, T, K]).
        q [B, T, H, D] -> [B, T, H, D]; K == V."""
        s = torch.einsum("bthd,bjd->bthj", q.float(), keys.float())
        s = s.masked_fill(~mask.unsqueeze(2), float("-inf"))
        if qkeys is not None:
            s2 = torch.einsum("bthd,btkd->bthk", q.float(), qkeys.float())
            s = torch.cat([s, s2.masked_fill(~qmask.unsqueeze(2), float("-inf"))], dim=-1)
        s = s * self.softmax_scale
        sink = self.attn_sink.float().view(1, 1, -1, 1).expand(s.shape[0], s.shape[1], -1, 1)
        p = torch.cat([s, sink], dim=-1).softmax(dim=-1)
        J = keys.shape[1]
        o = torch.einsum("bthj,bjd->bthd", p[..., :J], keys.float())
        if qkeys is not None:
            o = o + torch.einsum("bthk,btkd->bthd", p[..., J:-1], qkeys.float())
        return o.to(q.dtype)

    def _out(self, o: torch.Tensor, cs: torch.Tensor, rotated: bool = False) -> torch.Tensor:
        """o [..., H, D] -> inverse RoPE at the query position (unless already rotated) -> grouped low-rank
        projection -> [..., dim]."""
        if not rotated:
            o = apply_rope(o, cs.unsqueeze(-3), self.rope_dim, inverse=True)
        o = o.flatten(-2).unflatten(-1, (self.n_groups, -1))
        if isinstance(self.wo_a, Linear):
            wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
            z = torch.einsum("...gd,grd->...gr", o, wo_a)
        else:  # grouped NVFP4 projection (dsv4_model.quantize_model.Nvfp4GroupedLinear)
            z = self.wo_a(o)
        return self.wo_b(z.flatten(-2))

    # ------------------------------------------------------------------ prefill (from position 0)
    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        W, m, dev = self.window, self.ratio, x.device
        cs = rope[:S]
        qr, q, kv, _ = self._qkv(x, cs)
        self._write_window(kv, lengths)

        comp = ikeys = iq = None
        if self.indexer is not None:
            ikeys = self.indexer.compressor.prefill(x, lengths, rope)
            if ikeys is not None:
                self.indexer.store_prefill(ikeys)
                iq = self.indexer.queries(qr, cs.unsqueeze(-3))
        if self.compressor is not None:
            comp = self.compressor.prefill(x, lengths, rope)
            if comp is not None:
                self.kv_cache[:B, W: W + comp.shape[1]] = comp

        outs = []
        for t0 in range(0, S, self.prefill_chunk):
            t1 = min(S, t0 + self.prefill_chunk)
            j0 = max(0, t0 - W + 1)
            tq = torch.arange(t0, t1, device=dev).unsqueeze(1)
            tj = torch.arange(j0, t1, device=dev).unsqueeze(0)
            mask = ((tj <= tq) & (tj > tq - W)).unsqueeze(0).expand(B, -1, -1)
            keys = kv[:, j0:t1]
            qkeys = qmask = None
            if comp is not None:
                n = comp.shape[1]
                n_vis = (tq + 1) // m  # [T, 1]
                vis = torch.arange(n, device=dev).unsqueeze(0) < n_vis  # [T, n]
                if iq is not None:
                    sc = self.indexer.scores(iq[:, t0:t1], x[:, t0:t1], ikeys)
                    sc = sc.masked_fill(~vis, float("-inf"))
                    idx = topk_indices(sc, min(self.indexer.index_topk, n))
                    valid = idx < n_vis
                    if n <= self.prefill_dense_max_entries:
                        idx = torch.where(valid, idx, torch.full_like(idx, n))
                        sel = torch.zeros(B, t1 - t0, n + 1, dtype=torch.bool, device=dev)
                        vis = sel.scatter_(-1, idx, True)[..., :n]
                    else:
                        k = idx.shape[-1]
                        qkeys = comp.gather(1, idx.flatten(1).unsqueeze(-1).expand(-1, -1, comp.shape[-1]))
                        qkeys, qmask = qkeys.view(B, t1 - t0, k, -1), valid
                else:
                    vis = vis.unsqueeze(0).expand(B, -1, -1)
                if qkeys is None:
                    keys = torch.cat([keys, comp], dim=1)
                    mask = torch.cat([mask, vis], dim=-1)
            outs.append(self._attend(q[:, t0:t1], keys, mask, qkeys, qmask))
        return self._out(torch.cat(outs, dim=1), cs)

    def _write_window(self, kv: torch.Tensor, lengths: torch.Tensor) -> None:
        """Ring slot s <- the last position p < lengths[b] with p % W == s (left untouched if none)."""
        B, S, D = kv.shape
        W = self.window
        s = torch.arange(W, device=kv.device).unsqueeze(0)
        last = (lengths - 1).unsqueeze(1)
        p = s + W * torch.div(last - s, W, rounding_mode="floor")
        g = kv.gather(1, p.clamp(0, S - 1).unsqueeze(-1).expand(-1, -1, D))
        self.kv_cache[:B, :W] = torch.where((p >= 0).unsqueeze(-1), g, self.kv_cache[:B, :W])

    # ------------------------------------------------------------------ one-token decode (static shapes)
    def decode(self, x: torch.Tensor, positions: torch.Tensor, rope: dict) -> torch.Tensor:
        """x [B, dim] at per-row positions [B] (device tensor) -> [B, dim]; rope: the step's decode_rope of this
        layer's table. Updates caches rows [:B]."""
        B = x.shape[0]
        W, m, dev = self.window, self.ratio, x.device
        rows = torch.arange(B, device=dev)
        cs = rope_rows(rope, positions)
        qr, q, kv, iproj = self._qkv(x, cs, index_proj=True, positions=positions)
        cproj, iproj_c, wproj = self._fp32_projections(x)

        sel = sel_valid = sel_raw = None
        if self.indexer is not None:
            ix = self.indexer
            ientry, icomplete = ix.compressor.decode(x, positions, rope, iproj_c)
            packed = ix.packed_decode()
            if packed and _fused_key_store(ientry):
                torch.ops.dsv4.indexer_store_keys(ientry, positions, m, ix.kv_cache, ix.k_codes, ix.k_scales)
            else:
                self._write_entry(ix.kv_cache, 0, positions, ientry, icomplete)
                if packed:
                    codes, scales = indexer_fp4_quantize_keys(ientry)
                    self._write_entry(ix.k_codes, 0, positions, codes, icomplete)
                    self._write_entry(ix.k_scales, 0, positions, scales, icomplete)
            iq = ix.queries(qr, cs.unsqueeze(-3), iproj)
            k = min(ix.index_topk, self.n_entries)
            if packed:
                sel_raw = sel = ix.select(iq, x, visible_entries(rope, positions, m), k, wproj)
                sel_valid = sel >= 0
                sel = sel.clamp(min=0).long()
            else:
                sc = ix.scores(iq.unsqueeze(1), x.unsqueeze(1), ix.kv_cache[:B]).squeeze(1)
                n_vis = ((positions + 1) // m).unsqueeze(1)
                sc = sc.masked_fill(torch.arange(self.n_entries, device=dev).unsqueeze(0) >= n_vis, float("-inf"))
                sel = topk_indices(sc, k)
                sel_valid = sel < n_vis

        if kv is not None:  # else stored by _qkv
            self.kv_cache.index_put_((rows, positions % W), kv)
        if self.compressor is not None:
            entry, complete = self.compressor.decode(x, positions, rope, cproj, (positions, self.kv_cache, W))
            if entry is not None:
                self._write_entry(self.kv_cache, W, positions, entry, complete)

        listed = W + (sel.shape[1] if sel is not None else self.n_entries if self.ratio else 0)
        if _fused_decode_attention(B, listed, q) and q.dtype == self.kv_cache.dtype:
            extra = ()  # the op's (idx2, idx2_offset): the indexer's top-k after the window rows
            if sel is None:  # the same rows for every layer of this kind and shape: once per step
                rows = self._shared_rows(rope, positions, (W, m, self.n_entries))
            elif sel_raw is not None and _fused_sel_rows():
                rows, extra = self._shared_rows(rope, positions, (W, 0, 0)), (sel_raw, W)
            else:
                rows = self._decode_rows(positions, sel, sel_valid)
            out_rope = self.rope_dim > 0 and self.rope_dim % 4 == 0 and fused_on("DSV4_FUSED_OUT_ROPE")
            # with out_rope the output's inverse RoPE runs in the op's combine kernel (one kernel less)
            rot = (cs, self.rope_dim) if out_rope else (None, 0) if extra else ()
            o = torch.ops.dsv4.sparse_attn_decode(q, self.kv_cache[:B], rows, self.attn_sink, self.softmax_scale,
                                                  *rot, *extra)
            return self._out(o, cs, rotated=out_rope)
        keys = self.kv_cache[:B, :W]
        mask = (torch.arange(W, device=dev).unsqueeze(0) <= positions.unsqueeze(1)).unsqueeze(1)
        qkeys = qmask = None
        if sel is not None:
            qkeys = self.kv_cache[:B, W:].gather(1, sel.unsqueeze(-1).expand(-1, -1, self.head_dim)).unsqueeze(1)
            qmask = sel_valid.unsqueeze(1)
        elif self.ratio:
            cmask = torch.arange(self.n_entries, device=dev).unsqueeze(0) < ((positions + 1) // m).unsqueeze(1)
            keys = self.kv_cache[:B]
            mask = torch.cat([mask, cmask.unsqueeze(1)], dim=-1)
        o = self._attend(q.unsqueeze(1), keys, mask, qkeys, qmask).squeeze(1)
        return self._out(o, cs)

    def _shared_rows(self, rope: dict, positions: torch.Tensor, key: tuple) -> torch.Tensor:
        """The attended rows of a layer without an indexer of this (window, ratio, entries) key (ratio 0: the window
        alone), once per step and in the step's scratch buffer where there is one (read in place by every layer
        of the key)."""
        if key not in rope["attn_rows"]:
            rows = self._decode_rows(positions, None, None, ratio=key[1])
            buf = rope.get("attn_slots", {}).get(key)
            if buf is not None and buf.dtype == rows.dtype and buf.shape[2:] == rows.shape[1:]:
                rows = _in_slot((buf, [key]), key, rows)
            rope["attn_rows"][key] = rows
        return rope["attn_rows"][key]

    def _decode_rows(self, positions: torch.Tensor, sel: torch.Tensor | None,
                     sel_valid: torch.Tensor | None, ratio: int | None = None) -> torch.Tensor:
        """The cache rows a decode token attends, int32 [B, J], -1 where masked: the window slots written so far,
        then the indexer's selection (CSA) or every compressed entry closed so far (HCA; ratio: this layer's unless
        given, 0 for the window alone), at W + entry."""
        W, dev = self.window, positions.device
        ratio = self.ratio if ratio is None else ratio
        win = torch.arange(W, device=dev)
        parts = [torch.where(win.unsqueeze(0) <= positions.unsqueeze(1), win, -1)]
        if sel is not None:
            parts.append(torch.where(sel_valid, W + sel, -1))
        elif ratio:
            e = torch.arange(self.n_entries, device=dev)
            parts.append(torch.where(e.unsqueeze(0) < ((positions + 1) // ratio).unsqueeze(1), W + e, -1))
        return torch.cat(parts, dim=1).to(torch.int32)

    def _write_entry(self, cache: torch.Tensor, offset: int, positions: torch.Tensor, entry: torch.Tensor,
                     complete: torch.Tensor) -> None:
        """Write entry positions//m where the window just closed; rewrite the old value elsewhere."""
        B = entry.shape[0]
        n = cache.shape[1] - offset
        rows = torch.arange(B, device=entry.device)
        slot = offset + (positions // self.ratio).clamp(max=n - 1)
        old = cache[rows, slot]
        cache.index_put_((rows, slot), torch.where(complete.unsqueeze(1), entry.to(cache.dtype), old))
