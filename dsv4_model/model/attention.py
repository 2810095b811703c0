"""DeepSeek-V4 attention: shared K=V MQA over a sliding window plus compressed entries (CSA / HCA).

Shapes: B batch, S tokens, H heads, D head_dim (last `rd` dims carry RoPE), W window, m compress ratio.

Per-layer cache (non-persistent buffers, allocated by `alloc_runtime`):
  kv_cache [max_batch, R + ceil(max_seq_len / m), D]: slots 0..R-1 a ring (token p at p % R), slot R+i = entry i;
  R = W + spare slots (Transformer(spare_window_slots=): a token written ahead of what is kept, as a speculative
  step's rejected drafts, overwrites a position no later query reads; docs/speculation.md).
  compressor kv_state / score_state fp32 [max_batch, c*m, c*Dc] (c = 2 for the overlapping ratio-4 compressor).
  indexer kv_cache [max_batch, ceil(max_seq_len / m), index_head_dim] (FP4-rounded keys in the model dtype), and the
  same keys as DeepSeek's FP4 indexer cache: k_codes uint8 [.., index_head_dim / 2] + k_scales uint8 (UE8M0 per
  32) [.., index_head_dim / 32], 68 bytes per 128-dim key, which decode scores with dsv4::indexer_score_topk.
Validity is derived from positions only (ring slot s valid iff it holds one of positions p-W+1..p; entry i valid
iff i < (p+1)//m), so rows
never need clearing between sequences; prefill rewrites every compressor state row.

The compressor (dsv4_model.model.compressor), the indexer (dsv4_model.model.indexer, with its top-k order) and the values a
decode step shares between layers (dsv4_model.model.step_values) live in their own modules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dsv4_ops import ops, supports

from dsv4_model.model.compressor import Compressor, scatter_entries
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.indexer import Indexer, topk_indices
from dsv4_model.model.layers import (FloatWeight, GroupedLinear, Linear, RMSNorm, apply_rope, project,
                                     project_with_fp32, unweighted_rms_norm)
from dsv4_model.model.quant_sim import fp4_pack_indexer_keys, kv_fake_quant
from dsv4_model.model.step_values import DecodeStep, TokenSteps

# a prefill attention chunk's fp32 scores at most (bounds the chunk's rows; see Attention.prefill_rows)
PREFILL_SCORE_BYTES = 512 * 2**20


def _by_seq(t: torch.Tensor, seqs: int) -> torch.Tensor:
    """Decode rows [T * seqs, ...] (row t * seqs + b: token t of sequence b) -> [seqs, T, ...], a view: the
    tensor-op forms attend each sequence's tokens against its cache rows in one batch entry."""
    return t.view(-1, seqs, *t.shape[1:]).transpose(0, 1)


def _by_row(t: torch.Tensor) -> torch.Tensor:
    """_by_seq's inverse: [seqs, T, ...] -> [T * seqs, ...]."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def _rows_of(step: DecodeStep | TokenSteps, n: int) -> tuple[torch.Tensor, int]:
    """The positions of n decode rows and how many sequences they are tokens of: (step.positions, 0) for one
    token per row, (the stacked positions, n // T) for T tokens per row (0: one per row, as the ops' kv_batch)."""
    if isinstance(step, DecodeStep):
        return step.positions, 0
    return step.stacked.positions, n // len(step)


class PrefillAt(NamedTuple):
    """Where a prefill chunk sits: start int64 [B] (row b's first token's position), span (an int: every row's
    start + lengths is at most span, so a query sees at most span // m compressed entries; padding may run
    past it), fresh (the chunk starts every row at position 0 with nothing cached before: its entries are read
    as computed, not back from the caches), start_bound (an int >= every start when the host knows one: a query
    block then scores only the entries its last query can see)."""

    start: torch.Tensor
    span: int
    fresh: bool = False
    start_bound: int | None = None


class DecodeProjections(NamedTuple):
    """Decode tokens x [N, dim] at their rope rows cs and what Attention projects them to: _qkv's (qr, q, kv or
    None when stored already, iproj) and _fp32_projections' (cproj, iproj_c, wproj; each None where absent)."""

    x: torch.Tensor
    cs: torch.Tensor
    qr: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor | None
    iproj: torch.Tensor | None
    cproj: tuple[torch.Tensor, torch.Tensor] | None
    iproj_c: tuple[torch.Tensor, torch.Tensor] | None
    wproj: torch.Tensor | None

    def rows(self, lo: int, hi: int) -> "DecodeProjections":
        """Rows lo:hi of every tensor (decode_tokens: one token of each sequence)."""
        def part(v):
            if v is None:
                return None
            if isinstance(v, tuple):
                return tuple(u[lo:hi] for u in v)
            return v[lo:hi]
        return DecodeProjections(*(part(v) for v in self))


class Selection(NamedTuple):
    """The indexer's top-k entries for one decode token per row: idx int64 [B, k] (>= 0), valid bool [B, k], raw
    (the packed scorer's int32 answer, -1 where none, which the attention op reads as its second row list; None
    for the tensor-op scorer)."""

    idx: torch.Tensor
    valid: torch.Tensor
    raw: torch.Tensor | None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, max_batch: int, max_seq_len: int):
        super().__init__()
        self.ratio = cfg.layer_ratio(layer_id)
        self.n_heads, self.head_dim, self.rope_dim = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.window = cfg.window_size
        self.ring = self.window  # window ring slots (W + spare slots: Transformer sets it before allocating)
        self.eps = cfg.norm_eps
        self.n_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.max_batch = max_batch
        # ceil: a prefill chunk ending at max_seq_len writes the window past the last closed one (never visible)
        self.n_entries = -(-max_seq_len // self.ratio) if self.ratio else 0
        self.softmax_scale = self.head_dim**-0.5
        self.rope_kind = "compress" if self.ratio else "main"
        self.simulate_quant = True
        # query rows per prefill attention chunk; None: as many as keep a chunk's fp32 scores within
        # PREFILL_SCORE_BYTES (one chunk for short prompts and small models: no loop in an exported graph)
        self.prefill_attn_rows: int | None = None
        # CSA prefill: dense mask over all entries up to this many, else gather the top-k entries per query
        self.prefill_dense_max_entries = 2048
        H, D = self.n_heads, self.head_dim
        self.attn_sink = nn.Parameter(torch.empty(H, dtype=torch.float32), requires_grad=False)
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * D, dtype)
        self.wkv = Linear(cfg.dim, D, dtype)
        self.kv_norm = RMSNorm(D, cfg.norm_eps)
        self.wo_a = GroupedLinear(cfg.o_groups, H * D // cfg.o_groups, cfg.o_lora_rank, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dtype)
        self.compressor = Compressor(cfg, self.ratio, D, False, max_batch) if self.ratio else None
        self.indexer = Indexer(cfg, self.ratio, dtype, max_batch, max_seq_len) if self.ratio == 4 else None

    def alloc_runtime(self, device, dtype: torch.dtype) -> None:
        self.register_buffer("kv_cache", torch.zeros(self.max_batch, self.ring + self.n_entries, self.head_dim,
                                                     dtype=dtype, device=device), persistent=False)
        # Whether decode uses each dsv4 kernel (dsv4_ops.supports): the answers depend only on the model dtype (the
        # activations' and the cache's) and this layer's widths, so they are asked once here, not in every step.
        self.use_q_norm_op = supports.rms_norm_rope(dtype, self.q_norm.weight.shape[0], 0)
        self.use_norm_rope_op = supports.rms_norm_rope(dtype, self.head_dim, self.rope_dim)  # q, kv, entries
        self.use_store_op = supports.rms_norm_rope_store(dtype, self.kv_cache)  # kv / entries into kv_cache
        self.use_out_rope = supports.sparse_attn_decode_out_rope(self.rope_dim)
        self.use_attn_op = supports.sparse_attn_decode(dtype, self.kv_cache.dtype)  # else the tensor-op form
        self.attn_tensor_cores = supports.sparse_attn_decode_tensor_cores(dtype, self.head_dim)  # see _fused_attention

    # ------------------------------------------------------------------ shared pieces
    def _qkv(self, x: torch.Tensor, cs: torch.Tensor, decode: bool = False,
             positions: torch.Tensor | None = None, seqs: int = 0,
             qa_kva: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [..., dim] -> (qr [..., q_lora], q [..., H, D], kv [..., D], iproj); cs: rope rows for x's positions.
        decode (x [B, dim], one token per row): the norms and RoPE as dsv4 kernels where supports says so, and
        iproj the indexer's wq_b(qr), projected beside wq_b (in prefill, and without an indexer, None: the indexer
        projects qr itself). positions (decode): kv may go straight into the window of kv_cache at positions %
        window (then None); seqs: rows are tokens of that many sequences (row r writes sequence r % seqs's ring;
        0: one token per row); qa_kva: (wq_a(x), wkv(x)) when computed already."""
        qa, kva = project(x, self.wq_a, self.wkv) if qa_kva is None else qa_kva
        if decode and self.use_q_norm_op:  # a dsv4 kernel (PDL), not Inductor's reduction
            cs0 = qa.new_empty((qa.shape[0], 0, 2), dtype=torch.float32)
            qr = ops.rms_norm_rope(qa.unsqueeze(1), weight=self.q_norm.weight, cs=cs0, eps=self.q_norm.eps,
                                   rope_dim=0, fp8_nope=False).squeeze(1)
        else:
            qr = self.q_norm(qa)
        ix = self.indexer
        if decode and ix is not None:  # the indexer's wq_b reads qr too: one launch where the stored forms have one
            qb, iproj = project(qr, self.wq_b, ix.wq_b)
        else:
            qb, iproj = self.wq_b(qr), None
        q = qb.unflatten(-1, (self.n_heads, self.head_dim))
        if decode and self.use_norm_rope_op:  # cs [B, rope_dim / 2, 2]
            q = ops.rms_norm_rope(q, weight=None, cs=cs, eps=self.eps, rope_dim=self.rope_dim, fp8_nope=False)
            if positions is not None and self.use_store_op:
                ops.rms_norm_rope_store(kva, weight=self.kv_norm.weight, cs=cs, eps=self.kv_norm.eps,
                                        rope_dim=self.rope_dim, fp8_nope=self.simulate_quant, positions=positions,
                                        ratio=0, offset=0, slots=self.ring, cache=self.kv_cache, kv_batch=seqs)
                return qr, q, None, iproj
            kv = ops.rms_norm_rope(kva.unsqueeze(1), weight=self.kv_norm.weight, cs=cs, eps=self.kv_norm.eps,
                                   rope_dim=self.rope_dim, fp8_nope=self.simulate_quant).squeeze(1)
            return qr, q, kv, iproj
        q = apply_rope(unweighted_rms_norm(q, self.eps), cs.unsqueeze(-3), self.rope_dim)
        kv = apply_rope(self.kv_norm(kva), cs, self.rope_dim)
        if self.simulate_quant:
            kv = kv_fake_quant(kv, self.rope_dim)
        return qr, q, kv, iproj

    def _fp32_modules(self) -> list[Linear]:
        """The float Linears of the fp32-math projections of x at decode: the compressor's wkv, wgate, the same of
        the indexer's compressor, the indexer's weights_proj (when its packed scorer takes the fp32 product);
        each where present."""
        ix = self.indexer
        comp, icomp = self.compressor, (ix.compressor if ix is not None else None)
        wp = ix.weights_proj if ix is not None and ix.packed_decode() else None
        if wp is not None and not (type(wp) is Linear and isinstance(wp.form, FloatWeight)):
            wp = None
        mods = [lin for c in (comp, icomp) if c is not None for lin in (c.wkv, c.wgate)]
        return mods + ([wp] if wp is not None else [])

    def _fp32_projections(self, outs: tuple[torch.Tensor, ...]):
        """_fp32_modules' products (fp32) as ((wkv(x), wgate(x)) of the compressor or None, the same of the
        indexer's compressor or None, the indexer's weights_proj(x) in fp32 (Indexer.select has its op round it to
        the weight's dtype, as the module returns it) or None)."""
        ix = self.indexer
        icomp = ix.compressor if ix is not None else None
        it = iter(outs)
        cproj = (next(it), next(it)) if self.compressor is not None else None
        iproj = (next(it), next(it)) if icomp is not None else None
        return cproj, iproj, next(it, None)

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
        z = self.wo_a(o.flatten(-2).unflatten(-1, (self.n_groups, -1)))
        return self.wo_b(z.flatten(-2))

    # ------------------------------------------------------------------ prefill (a chunk from any position)
    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, rope: torch.Tensor, at: "PrefillAt") -> torch.Tensor:
        """x [B, S, dim]: row b's tokens at positions at.start[b] + t -> [B, S, dim]; rows valid for their first
        lengths[b] tokens. The caches rows [:B] hold each row's positions before its start (an earlier chunk's
        prefill, or decode) and then hold the valid tokens too (a row of length 0: nothing its later decode
        reads changes). Shapes depend on S, at.span and at.start_bound only (not on the starts)."""
        B, S, _ = x.shape
        W, R, m, dev = self.window, self.ring, self.ratio, x.device
        start = at.start.unsqueeze(1)  # [B, 1]
        t = torch.arange(S, device=dev)
        cs = rope[(start + t).clamp(max=rope.shape[0] - 1)]  # [B, S, rope_dim / 2, 2]
        qr, q, kv, _ = self._qkv(x, cs)
        # keys: the W - 1 positions before start from the ring (read before the chunk overwrites it), then the
        # chunk's; key j is position start - (W - 1) + j (those < 0 masked)
        P = W - 1
        before = start - P + torch.arange(P, device=dev)  # [B, P] positions
        old = self.kv_cache[:B].detach().gather(1, (before % R).unsqueeze(-1).expand(-1, -1, kv.shape[-1]))
        old = torch.where((before >= 0).unsqueeze(-1), old, 0.0)  # a stale NaN must not meet a zero weight
        kv_all = torch.cat([old, kv], dim=1)
        self._write_window(kv, lengths, start)

        comp = ikeys = iq = None
        n_span = at.span // m if m else 0  # the entries a query of the chunk can see at most
        if self.indexer is not None and n_span:
            ix = self.indexer
            ikeys = self._prefill_entries(ix.compressor, ix.kv_cache, 0, x, lengths, rope, at, n_span,
                                          ix.store_prefill)
            iq = ix.queries(qr, cs.unsqueeze(-3))
        if self.compressor is not None and n_span:
            comp = self._prefill_entries(self.compressor, self.kv_cache, R, x, lengths, rope, at, n_span)
        elif self.compressor is not None:  # no window closes: the compressor states still advance
            self.compressor.prefill(x, lengths, rope, at.start, at.fresh)
            if self.indexer is not None:
                self.indexer.compressor.prefill(x, lengths, rope, at.start, at.fresh)

        first_ok = P - start  # [B, 1]: key j is at a position >= 0 from here
        if self.prefill_attn_op(x):
            return self._out(self._prefill_attend_op(q, kv_all, comp, n_span, iq, ikeys, x, at, first_ok), cs)
        outs = []
        rows = self.prefill_rows(B, S, n_span)
        kv_f = kv_all.float()  # once: every query block's window keys are views of it
        for t0 in range(0, S, rows):
            t1 = min(S, t0 + rows)
            blk = vis = qkeys = qmask = None
            n, n_vis, idx = self._block_entries(0 if comp is None else min(n_span, comp.shape[1]), t0, t1, at,
                                                iq, x, ikeys)
            if n:
                blk = comp[:, :n]
                vis = torch.arange(n, device=dev).view(1, 1, -1) < n_vis  # [B, T, n]
                if idx is not None:
                    valid = idx < n_vis
                    if n <= self.prefill_dense_max_entries:
                        idx = torch.where(valid, idx, torch.full_like(idx, n))
                        sel = torch.zeros(B, t1 - t0, n + 1, dtype=torch.bool, device=dev)
                        vis = sel.scatter_(-1, idx, True)[..., :n]
                    else:
                        k = idx.shape[-1]
                        qkeys = blk.gather(1, idx.flatten(1).unsqueeze(-1).expand(-1, -1, blk.shape[-1]))
                        qkeys, qmask = qkeys.view(B, t1 - t0, k, -1), valid
                        blk = vis = None
            outs.append(self._attend_window(q[:, t0:t1], kv_f, t0, first_ok, blk, vis, qkeys, qmask))
        return self._out(torch.cat(outs, dim=1), cs)

    def prefill_attn_op(self, x: torch.Tensor) -> bool:
        """Whether prefill attends with dsv4::sparse_attn_decode, each query a row listing its keys: on CUDA where
        decode's tensor-core kernel takes this layer (heads as the MMA's rows, as FlashMLA's sparse kernels), no
        gradient. Elsewhere the torch form (_attend_window)."""
        return (x.device.type == "cuda" and self.use_attn_op and self.attn_tensor_cores
                and not torch.is_grad_enabled())

    def _prefill_attend_op(self, q: torch.Tensor, kv_all: torch.Tensor, comp: torch.Tensor | None, n_span: int,
                           iq: torch.Tensor | None, ikeys: torch.Tensor | None, x: torch.Tensor, at: "PrefillAt",
                           first_ok: torch.Tensor) -> torch.Tensor:
        """prefill's attention with one dsv4::sparse_attn_decode call per block of query rows: the keys of every
        row (its window kv_all [B, W - 1 + S, D], then its n_span compressed entries) in one buffer that every
        query reads through a stride-0 view; query t of row b lists its window rows (those at positions >= 0) and
        its entries: the indexer's top-k of those it sees (CSA), or all it sees (HCA). Returns o [B, S, H, D]."""
        B, S, H, D = q.shape
        P, dev = self.window - 1, q.device
        n = 0 if comp is None else min(n_span, comp.shape[1])
        L = P + S + n  # keys per batch row in the buffer
        buf = torch.cat([kv_all, comp[:, :n]], dim=1) if n else kv_all
        kv = buf.reshape(1, B * L, D)
        base = (torch.arange(B, device=dev) * L).view(B, 1, 1)
        # rows per call: the op's fp32 workspace [B * rows, H, D] per split (0.5 GiB at V4 widths) and the indexer's
        # scores [B, rows, n] (PREFILL_SCORE_BYTES) bound them; no [H, rows, keys] scores exist on this path
        rows = min(self.prefill_attn_rows or max(64, PREFILL_SCORE_BYTES // (4 * B * max(n, 1))), S,
                   max(1, 4096 // B))
        outs = []
        for t0 in range(0, S, rows):
            t1 = min(S, t0 + rows)
            tq = torch.arange(t0, t1, device=dev).view(1, -1, 1)
            win = tq + torch.arange(P + 1, device=dev).view(1, 1, -1)  # [1, T, W] indices into kv_all
            idx = torch.where(win >= first_ok.view(B, 1, 1), win + base, -1)  # [B, T, W]
            idx2 = None
            nb, n_vis, e = self._block_entries(n, t0, t1, at, iq, x, ikeys)
            if nb:
                e = torch.arange(nb, device=dev).view(1, 1, nb) if e is None else e  # HCA: every entry seen
                idx2 = torch.where(e < n_vis, e + base, -1)  # [B, T, k | n]
            T = t1 - t0
            o = ops.sparse_attn_decode(q[:, t0:t1].reshape(B * T, H, D), kv.expand(B * T, -1, -1),
                                       idx.reshape(B * T, -1), sink=self.attn_sink, scale=self.softmax_scale,
                                       idx2=None if idx2 is None else idx2.reshape(B * T, -1),
                                       idx2_offset=P + S)
            outs.append(o.view(B, T, H, D))
        return torch.cat(outs, dim=1)

    def _block_entries(self, n: int, t0: int, t1: int, at: "PrefillAt", iq: torch.Tensor | None, x: torch.Tensor,
                       ikeys: torch.Tensor | None) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """The compressed entries queries t0 .. t1 - 1 of a chunk may attend, of the first n: (n trimmed to those
        closed by the block's last query at most, n_vis [B, T, 1] the entries each query has seen, the indexer's
        top-k [B, T, k] over them (CSA; None without an indexer)); (0, None, None) when there are none."""
        m = self.ratio
        if n and at.start_bound is not None:  # the later ones no query of the block sees
            n = min(n, (at.start_bound + t1) // m)
        if not n:
            return 0, None, None
        tq = torch.arange(t0, t1, device=x.device).view(1, -1, 1)
        n_vis = (at.start.view(-1, 1, 1) + tq + 1) // m  # [B, T, 1]
        if iq is None:
            return n, n_vis, None
        sc = self.indexer.prefill_scores(iq[:, t0:t1], x[:, t0:t1], ikeys[:, :n], n_vis.squeeze(-1))
        k = min(self.indexer.index_topk, n)
        # on CUDA one dsv4::indexer_topk (the same indices in the same order; torch.topk of the composite costs
        # ~10% of a long compiled prefill there: bench/RESULTS.md, session 34)
        return n, n_vis, ops.indexer_topk(sc, k) if supports.indexer_topk(sc.device, k) else topk_indices(sc, k)

    def _attend_window(self, q: torch.Tensor, kv_f: torch.Tensor, t0: int, first_ok: torch.Tensor,
                       blk: torch.Tensor | None = None, vis: torch.Tensor | None = None,
                       qkeys: torch.Tensor | None = None, qmask: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill's _attend: one softmax (fp32, the per-head sink in the denominator) per query of q [B, T, H, D]
        (chunk positions t0 ..) over its sliding window -- the W keys of kv_f (fp32 [B, W - 1 + S, D]; key i is
        chunk position i - (W - 1)) ending at it, those at indices < first_ok [B, 1] (positions < 0) masked -- and
        the shared entries blk [B, n, D] (mask vis [B, T, n]) or per-query entries qkeys [B, T, K, D] (qmask).
        The window runs in sub-blocks of W queries, each scoring the 2W - 1 keys its queries see (a strided view
        of kv_f) against a band mask: not one [T, T + W - 1] mask over the block, whose products grow with T.
        K == V. -> [B, T, H, D]."""
        B, T, H, D = q.shape
        R, P, dev = self.window, self.window - 1, q.device
        nb = -(-T // R)
        pad = nb * R - T
        qf = q.float()
        qb = torch.nn.functional.pad(qf, (0, 0, 0, 0, 0, pad)).view(B, nb, R, H, D)
        keys = kv_f[:, t0:t0 + nb * R + P]
        keys = torch.nn.functional.pad(keys, (0, 0, 0, nb * R + P - keys.shape[1]))  # (the padded queries' only)
        kw = keys.unfold(1, R + P, R)  # [B, nb, D, R + P]: sub-block i's keys t0 + iR .. t0 + iR + R + P - 1
        r = torch.arange(R, device=dev).view(R, 1)
        j = torch.arange(R + P, device=dev).view(1, R + P)
        at = t0 + R * torch.arange(nb, device=dev).view(1, nb, 1, 1) + j  # [1, nb, 1, R + P] indices into kv_f
        wmask = (j >= r) & (j <= r + P) & (at >= first_ok.view(B, 1, 1, 1))  # [B, nb, R, R + P]
        s = torch.einsum("bnrhd,bndj->bnrhj", qb, kw).masked_fill(~wmask.unsqueeze(3), float("-inf"))
        parts = [s.flatten(1, 2)[:, :T]]  # [B, T, H, R + P]
        if blk is not None:
            parts.append(torch.einsum("bthd,bnd->bthn", qf, blk.float()).masked_fill(~vis.unsqueeze(2),
                                                                                     float("-inf")))
        if qkeys is not None:
            parts.append(torch.einsum("bthd,btkd->bthk", qf, qkeys.float()).masked_fill(~qmask.unsqueeze(2),
                                                                                        float("-inf")))
        s = torch.cat(parts, dim=-1) * self.softmax_scale
        sink = self.attn_sink.float().view(1, 1, -1, 1).expand(B, T, -1, 1)
        p = torch.cat([s, sink], dim=-1).softmax(dim=-1)
        pw = torch.nn.functional.pad(p[..., :R + P], (0, 0, 0, 0, 0, pad)).view(B, nb, R, H, R + P)
        o = torch.einsum("bnrhj,bndj->bnrhd", pw, kw).flatten(1, 2)[:, :T]
        off = R + P
        if blk is not None:
            o = o + torch.einsum("bthn,bnd->bthd", p[..., off:off + blk.shape[1]], blk.float())
            off += blk.shape[1]
        if qkeys is not None:
            o = o + torch.einsum("bthk,btkd->bthd", p[..., off:off + qkeys.shape[2]], qkeys.float())
        return o.to(q.dtype)

    def _prefill_entries(self, compressor: Compressor, cache: torch.Tensor, offset: int, x: torch.Tensor,
                         lengths: torch.Tensor, rope: torch.Tensor, at: "PrefillAt", n_span: int,
                         store=None) -> torch.Tensor:
        """The first n_span compressed entries, [B, n_span, D], after writing the chunk's into rows [:B] of cache
        from offset (by store(entries, indices, rows written) if given). From position 0 with at.fresh they are
        the computed tensor itself (what a gradient flows through when training)."""
        B = x.shape[0]
        new, e = compressor.prefill(x, lengths, rope, at.start, at.fresh)
        if store is not None:
            store(new, e, lengths > 0)
        else:
            scatter_entries(cache, offset + e, new, lengths > 0)
        comp = new[:, :n_span] if at.fresh else cache[:B, offset: offset + n_span]
        # zero the entries no valid token of the row closed (junk, or whatever the cache held): a masked key
        # must not be NaN (0 * NaN in the attention's weighted sum)
        closed = ((at.start + lengths) // self.ratio).view(B, 1, 1)
        return torch.where(torch.arange(comp.shape[1], device=x.device).view(1, -1, 1) < closed, comp, 0.0)

    def prefill_rows(self, B: int, S: int, n_entries: int) -> int:
        """Query rows per prefill chunk: ``prefill_attn_rows`` if set, else S halved until the chunk's scores
        [B, H, rows, 2 window + entries] fit PREFILL_SCORE_BYTES (keys over-counted for the top-k path)."""
        if self.prefill_attn_rows is not None:
            return self.prefill_attn_rows
        rows = S
        while rows > 64 and B * self.n_heads * rows * (2 * self.window + n_entries) * 4 > PREFILL_SCORE_BYTES:
            rows = (rows + 1) // 2
        return rows

    def _write_window(self, kv: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor) -> None:
        """Ring slot s <- the last position p < start + lengths[b] with p % R == s, where p >= start (kv [B, S, D]
        holds positions start[b] .., start [B, 1]); the other slots are left as they are."""
        B, S, D = kv.shape
        R = self.ring
        s = torch.arange(R, device=kv.device).unsqueeze(0)
        last = start + (lengths - 1).unsqueeze(1)
        t = s + R * torch.div(last - s, R, rounding_mode="floor") - start
        g = kv.gather(1, t.clamp(0, S - 1).unsqueeze(-1).expand(-1, -1, D))
        self.kv_cache[:B, :R] = torch.where((t >= 0).unsqueeze(-1), g, self.kv_cache[:B, :R])

    # ------------------------------------------------------------------ one-token decode (static shapes)
    def decode(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x [B, dim] at the step's per-row positions -> [B, dim]. Updates caches rows [:B]."""
        cs = step.cs(self.rope_kind)
        o, rotated = self._decode_attend(self._decode_projections(x, cs, step.positions), step)
        return self._out(o, cs, rotated=rotated)

    def decode_tokens(self, x: torch.Tensor, steps: TokenSteps) -> torch.Tensor:
        """T tokens per row at once: x [T * B, dim] (row t * B + b: token t of sequence b, at steps[t]'s
        positions) -> [T * B, dim]. The projections run on all T * B rows (their weights read once). Where the ring
        has T - 1 spare slots (a speculative model verifying K + 1 tokens) every other op runs once for the T * B
        rows too: the compressors advance each row's state token after token inside their op, then the cache
        writes, the indexer's selection and the attention, each row at its own position (steps.stacked): what a
        later token wrote is outside an earlier one's window (its slot held a position W + spare back) and past
        its visible entries, so each token sees what its own decode step would. Else token after token, as T
        decode steps would."""
        T = len(steps)
        B = x.shape[0] // T
        cs = steps.stacked.cs(self.rope_kind)  # the T tokens' rows, gathered once per step (not per layer)
        together = 1 < T <= self.ring - self.window + 1
        # together, the window's kv goes into the ring inside the norm's op (one launch, as a decode step's)
        p = self._decode_projections(x, cs, *((steps.stacked.positions, B) if together else ()))
        if not together:
            outs, rotated = [], False
            for t, st in enumerate(steps):
                o, rotated = self._decode_attend(p.rows(t * B, (t + 1) * B), st)
                outs.append(o)
            return self._out(torch.cat(outs), cs, rotated=rotated)
        if self.indexer is not None:
            self._decode_index_store(p, steps)
        self._decode_store(p, steps)
        o, rotated = self._decode_attend(p, steps.stacked, seqs=B, stored=True)
        return self._out(o, cs, rotated=rotated)

    def _decode_projections(self, x: torch.Tensor, cs: torch.Tensor, positions: torch.Tensor | None = None,
                            seqs: int = 0) -> "DecodeProjections":
        """Every projection of decode tokens x [N, dim] (_qkv's, then _fp32_projections'); positions, seqs: as
        _qkv's. wq_a, wkv and the fp32-math projections of x go in one call (project_with_fp32)."""
        qa_kva, f32 = project_with_fp32(x, (self.wq_a, self.wkv), self._fp32_modules())
        qr, q, kv, iproj = self._qkv(x, cs, decode=True, positions=positions, seqs=seqs, qa_kva=qa_kva)
        return DecodeProjections(x, cs, qr, q, kv, iproj, *self._fp32_projections(f32))

    def _decode_attend(self, p: "DecodeProjections", step: DecodeStep, seqs: int | None = None,
                       stored: bool = False) -> tuple[torch.Tensor, bool]:
        """One decode token per row after its projections: the indexer's selection, the cache writes (unless
        stored: done already) and the attention, by the op or the tensor-op form as the step's options decide ->
        (o [N, H, D], whether o is already inverse-rotated). seqs: the rows are tokens of that many sequences,
        row n of sequence n % seqs (decode_tokens), else one per sequence."""
        if not stored and self.indexer is not None:
            self._decode_index_store(p, step)
        sel = self._decode_index_select(p, step, seqs) if self.indexer is not None else None
        if not stored:
            self._decode_store(p, step)
        N = p.x.shape[0]
        listed = self.ring + (sel.idx.shape[1] if sel is not None else self.n_entries if self.ratio else 0)
        if self.fused_attention(N, listed, step):
            return self._decode_attend_op(p.q, p.cs, step, sel, seqs)
        return self._decode_attend_reference(p.q, step, sel, seqs), False

    def fused_attention(self, batch: int, listed: int, step: DecodeStep) -> bool:
        """Whether decode attends with dsv4::sparse_attn_decode (one op instead of a gather, two GEMMs per key set,
        masks and a softmax) for `batch` queries attending `listed` cache rows each (static when the step is
        traced): where the op takes this layer's q / kv (asked at setup), always under the step's
        DecodeOptions.attention "fused", never under "torch", and under "auto" where it is the faster form: its
        tensor-core kernel at every measured size (unless the step's attn_kernel override forces the CUDA-core
        one), the CUDA-core kernel up to supports.FUSED_ATTN_MAX_ROWS."""
        form = step.options.attention
        if form == "torch" or not self.use_attn_op:
            return False
        return (form == "fused" or (self.attn_tensor_cores and not step.attn_simt)
                or batch * listed <= supports.FUSED_ATTN_MAX_ROWS)

    def _decode_index_store(self, p: "DecodeProjections", step: DecodeStep | TokenSteps) -> None:
        """CSA: the indexer's compressor advances (over T tokens per row: token after token), its entries stored
        where a window just closed (_store_index_entry)."""
        comp, (positions, seqs) = self.indexer.compressor, _rows_of(step, p.x.shape[0])
        ientry, icomplete = comp.decode(p.x, step, self.rope_kind, p.iproj_c)
        self._store_index_entry(ientry, icomplete, positions, self.indexer.packed_decode(), seqs)

    def _decode_index_select(self, p: "DecodeProjections", step: DecodeStep, seqs: int | None) -> "Selection":
        """CSA: the indexer's top-k of the entries each row's token sees (seqs: as _decode_attend's)."""
        ix, m, positions = self.indexer, self.ratio, step.positions
        iq = ix.queries(p.qr, p.cs.unsqueeze(-3), p.iproj)
        k = min(ix.index_topk, self.n_entries)
        if ix.packed_decode():
            raw = ix.select(iq, p.x, step.visible(m), k, p.wproj, seqs)
            valid = raw >= 0
            return Selection(raw.clamp(min=0).long(), valid, raw)
        S = seqs or p.x.shape[0]
        sc = _by_row(ix.scores(_by_seq(iq, S), _by_seq(p.x, S), ix.kv_cache[:S]))
        n_vis = ((positions + 1) // m).unsqueeze(1)
        sc = sc.masked_fill(torch.arange(self.n_entries, device=p.x.device).unsqueeze(0) >= n_vis, float("-inf"))
        sel = topk_indices(sc, k)
        return Selection(sel, sel < n_vis, None)

    def _store_index_entry(self, entry: torch.Tensor, complete: torch.Tensor, positions: torch.Tensor,
                           packed: bool, seqs: int = 0) -> None:
        """The indexer's compressed key where its window just closed: into its kv_cache and, for the packed
        scorer (packed: Indexer.packed_decode), its FP4 codes / scales (one dsv4::indexer_store_keys call where
        the op takes the keys). seqs: the rows are tokens of that many sequences (_rows_of)."""
        ix = self.indexer
        if packed and ix.use_store_keys_op:
            ops.indexer_store_keys(entry, positions=positions, ratio=self.ratio, kv_cache=ix.kv_cache,
                                   k_codes=ix.k_codes, k_scales=ix.k_scales, kv_batch=seqs)
            return
        self._write_entry(ix.kv_cache, 0, positions, entry, complete, seqs)
        if packed:
            codes, scales = fp4_pack_indexer_keys(entry)
            self._write_entry(ix.k_codes, 0, positions, codes, complete, seqs)
            self._write_entry(ix.k_scales, 0, positions, scales, complete, seqs)

    def _decode_store(self, p: "DecodeProjections", step: DecodeStep | TokenSteps) -> None:
        """The tokens' kv into the window ring (unless _qkv stored it already) and the compressor's entries where
        a window just closed (over T tokens per row its state advances token after token, the entries are written
        at once)."""
        (positions, seqs), R = _rows_of(step, p.x.shape[0]), self.ring
        if p.kv is not None:
            rows = torch.arange(p.x.shape[0], device=p.x.device)
            self.kv_cache.index_put_((rows % seqs if seqs else rows, positions % R), p.kv)
        if self.compressor is not None:
            store = (positions, self.kv_cache, R, seqs) if self.use_store_op else None
            entry, complete = self.compressor.decode(p.x, step, self.rope_kind, p.cproj, store)
            if entry is not None:
                self._write_entry(self.kv_cache, R, positions, entry, complete, seqs)

    def _decode_attend_op(self, q: torch.Tensor, cs: torch.Tensor, step: DecodeStep, sel: "Selection | None",
                          seqs: int | None = None) -> tuple[torch.Tensor, bool]:
        """The attention as one dsv4::sparse_attn_decode call over the listed cache rows -> (o, whether the op
        applied the output's inverse RoPE). seqs: as _decode_attend's (the op's kv_batch)."""
        R, m, B = self.ring, self.ratio, seqs or q.shape[0]
        idx2, idx2_offset = None, 0  # the indexer's top-k after the window rows, as the op's second row list
        if sel is None:  # the same rows for every layer of this kind and shape: once per step
            rows = self._shared_rows(step, (R, m, self.n_entries))
        elif sel.raw is not None:
            rows, idx2, idx2_offset = self._shared_rows(step, (R, 0, 0)), sel.raw, R
        else:
            rows = self._decode_rows(step.positions, sel.idx, sel.valid)
        out_rope = self.use_out_rope  # the output's inverse RoPE in the op's combine kernel (one kernel less)
        o = ops.sparse_attn_decode(q, self.kv_cache[:B], rows, sink=self.attn_sink, scale=self.softmax_scale,
                                   out_rope=cs if out_rope else None, rope_dim=self.rope_dim if out_rope else 0,
                                   idx2=idx2, idx2_offset=idx2_offset, kv_batch=seqs or 0)
        return o, out_rope

    def _decode_attend_reference(self, q: torch.Tensor, step: DecodeStep, sel: "Selection | None",
                                 seqs: int | None = None) -> torch.Tensor:
        """The attention in tensor ops (_attend): the window's ring slots, then the selected entries (CSA) or
        every entry closed so far (HCA) -> o [B, H, D], not inverse-rotated. seqs: as _decode_attend's."""
        R, m, positions, S = self.ring, self.ratio, step.positions, seqs or q.shape[0]
        cache = self.kv_cache[:S]  # each sequence's T query tokens attend its cache together (_by_seq)
        keys = cache[:, :R]
        mask = _by_seq(self._window_slots_held(positions), S)
        qkeys = qmask = None
        if sel is not None:
            k = sel.idx.shape[1]
            rows = _by_seq(sel.idx, S).reshape(S, -1, 1).expand(-1, -1, self.head_dim)
            qkeys = cache[:, R:].gather(1, rows).view(S, -1, k, self.head_dim)
            qmask = _by_seq(sel.valid, S)
        elif self.ratio:
            cmask = torch.arange(self.n_entries, device=q.device).unsqueeze(0) < ((positions + 1) // m).unsqueeze(1)
            keys = cache
            mask = torch.cat([mask, _by_seq(cmask, S)], dim=-1)
        return _by_row(self._attend(_by_seq(q, S), keys, mask, qkeys, qmask))

    def _shared_rows(self, step: DecodeStep, key: tuple) -> torch.Tensor:
        """The attended rows of a layer without an indexer of this (ring slots, ratio, entries) key (ratio 0: the
        window alone), once per step and in the step's scratch buffer (read in place by every layer of the key)."""
        return step.shared_rows(key, lambda: self._decode_rows(step.positions, None, None, ratio=key[1]))

    def _decode_rows(self, positions: torch.Tensor, sel: torch.Tensor | None,
                     sel_valid: torch.Tensor | None, ratio: int | None = None) -> torch.Tensor:
        """The cache rows a decode token attends, int32 [B, J], -1 where masked: the window's ring slots
        (_window_rows), then the indexer's selection (CSA) or every compressed entry closed so far (HCA; ratio: this
        layer's unless given, 0 for the window alone), at R + entry."""
        R, dev = self.ring, positions.device
        ratio = self.ratio if ratio is None else ratio
        parts = [self._window_rows(positions)]
        if sel is not None:
            parts.append(torch.where(sel_valid, R + sel, -1))
        elif ratio:
            e = torch.arange(self.n_entries, device=dev)
            parts.append(torch.where(e.unsqueeze(0) < ((positions + 1) // ratio).unsqueeze(1), R + e, -1))
        return torch.cat(parts, dim=1).to(torch.int32)

    def _window_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, R]: the ring slots of positions p - R + 1 .. p in position order (p = the row's position), -1 for
        those outside the window p - W + 1 .. p or below 0. Listed by position, not by slot, so the attention's
        sums (dsv4::sparse_attn_decode adds the listed rows in list order) run in one order whatever the ring's
        slot count: a model with spare slots (speculation) gives the plain ring's logits bit for bit."""
        W, R = self.window, self.ring
        pos = positions.unsqueeze(1) - (R - 1) + torch.arange(R, device=positions.device).unsqueeze(0)
        return torch.where((pos >= 0) & (pos > positions.unsqueeze(1) - W), pos.remainder(R), -1)

    def _window_slots_held(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, R] bool: ring slot s holds one of positions p-W+1..p (p = the row's position)."""
        W, R = self.window, self.ring
        s = torch.arange(R, device=positions.device).unsqueeze(0)
        p = positions.unsqueeze(1)
        if R == W:  # every slot holds a position of the window once the ring has filled
            return s <= p
        held = s + R * torch.div(p - s, R, rounding_mode="floor")  # the latest position <= p in slot s
        return (held >= 0) & (held > p - W)

    def _write_entry(self, cache: torch.Tensor, offset: int, positions: torch.Tensor, entry: torch.Tensor,
                     complete: torch.Tensor, seqs: int = 0) -> None:
        """Write entry positions//m where the window just closed; rewrite the old value elsewhere. seqs: the rows
        are tokens of that many sequences, T = rows / seqs each, in one write as if token after token: tokens of a
        sequence naming one slot all write what the last of them that closes it writes (else the old value), so
        the write's duplicate indices carry equal values."""
        n = cache.shape[1] - offset
        slot = (positions // self.ratio).clamp(max=n - 1)
        rows = torch.arange(entry.shape[0], device=entry.device)
        if seqs:
            T = entry.shape[0] // seqs
            st, ct = slot.view(T, seqs), complete.view(T, seqs)
            closes = (st.unsqueeze(1) == st.unsqueeze(0)) & ct.unsqueeze(0)  # [t, t', b]: t' closes t's slot
            last = (closes * torch.arange(1, T + 1, device=entry.device).view(1, T, 1)).argmax(dim=1)  # [T, seqs]
            rows = rows % seqs
            entry = entry[(last * seqs + rows.view(T, seqs)).flatten()]
            complete = closes.any(dim=1).flatten()
        old = cache[rows, offset + slot]
        cache.index_put_((rows, offset + slot), torch.where(complete.unsqueeze(1), entry.to(cache.dtype), old))
