"""DeepSeek-V4's KV compressor: gated pooling of m consecutive tokens into one cache entry (overlapping 2m-token
windows when m == 4), for the attention cache (CSA / HCA layers) and the indexer's keys (dsv4_model.model.attention
describes the caches)."""

from __future__ import annotations

import torch
from torch import nn

from dsv4_ops import ops, supports

from dsv4_model.model.config import ModelConfig
from dsv4_model.model.layers import Linear, RMSNorm, apply_rope, narrow_if_lossless_, project
from dsv4_model.model.quant_sim import indexer_fake_quant, kv_fake_quant
from dsv4_model.model.step_values import DecodeStep, TokenSteps


def scatter_entries(cache: torch.Tensor, index: torch.Tensor, values: torch.Tensor, write: torch.Tensor) -> None:
    """cache[b, index[b, i]] = values[b, i] (rows [:B]; index int64 [B, n], consecutive per row) for the rows b
    where write[b]; the other rows keep what they hold. Indices past the cache (windows past max_seq_len: junk
    a padded chunk computes; a row with nothing in the chunk may sit anywhere) write what the last index gets
    (its new value, or the old one), so a repeated index always carries one value."""
    B, n, D = values.shape[0], values.shape[1], values.shape[-1]
    rows = cache[:B]
    last = cache.shape[1] - 1
    w = torch.arange(n, device=index.device).unsqueeze(0)
    src = torch.where(index > last, w - (index - last), w)  # past the end: the position that writes `last`
    idx = index.clamp(max=last).unsqueeze(-1).expand(-1, -1, D)
    new = values.gather(1, src.clamp(min=0).unsqueeze(-1).expand(-1, -1, D)).to(cache.dtype)
    take = (write.unsqueeze(1) & (src >= 0)).unsqueeze(-1)
    rows.scatter_(1, idx, torch.where(take, new, rows.gather(1, idx)))


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
        # > 0 (Transformer(spare_window_slots=)): the state is a ring of c*m + spare rows indexed by position
        # instead of shifted when a window closes, so tokens written ahead leave nothing behind (docs/speculation.md)
        self.spare = 0
        c = self.coff
        self.ape = nn.Parameter(torch.empty(ratio, c * head_dim, dtype=torch.float32), requires_grad=False)
        # checkpoint stores bf16; official runs the compressor projections in fp32
        self.wkv = Linear(cfg.dim, c * head_dim, torch.float32, fp32=True)
        self.wgate = Linear(cfg.dim, c * head_dim, torch.float32, fp32=True)
        self.norm = RMSNorm(head_dim, cfg.norm_eps)

    def alloc_runtime(self, device, dtype: torch.dtype) -> None:
        c, m = self.coff, self.ratio
        shape = (self.max_batch, c * m + self.spare, c * self.head_dim)
        self.register_buffer("kv_state", torch.zeros(shape, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("score_state", torch.full(shape, float("-inf"), dtype=torch.float32, device=device),
                             persistent=False)
        # What decode's dsv4 kernels take (dsv4_ops.supports) for entries of the model dtype and this width: asked
        # once here, not in every step. The op rounds its pooling to pooled_dtype itself.
        self.pooled_dtype = dtype if supports.compressor_decode_pooled(dtype) else torch.float32
        self.use_norm_rope_op = supports.rms_norm_rope(dtype, self.head_dim, self.rope_dim)
        self.use_hadamard_op = supports.hadamard_fp4(dtype, self.head_dim)

    def narrow_weights_(self, lossless: bool | None = None) -> None:
        """wkv / wgate in bf16 when lossless (layers.narrow_if_lossless_): decode reads half the bytes, every
        result unchanged. Call once the weights are in place (Transformer.narrow_weights_): anything copied in
        later would be rounded to bf16."""
        for lin in (self.wkv, self.wgate):
            narrow_if_lossless_(lin, lossless)

    def reset_state(self) -> None:
        self.kv_state.zero_()
        self.score_state.fill_(float("-inf"))

    def _finish(self, pooled: torch.Tensor, cs: torch.Tensor, dtype: torch.dtype, store=None) -> torch.Tensor | None:
        """Pooled entries -> cache entries: RMSNorm, RoPE, and the simulated FP8 (KV) or Hadamard + FP4 (indexer
        keys) rounding; at decode (one entry per row) through the fused ops where they take the shapes. store:
        (positions, cache, offset, seqs) at decode, given where the fused op can write that cache: the entry is
        written into cache where its window closed (returns None; seqs > 0: row r into cache row r % seqs, T tokens
        of seqs sequences); else returned for the caller to write."""
        decode, x = pooled.dim() == 2, pooled.to(dtype)
        if decode and self.use_norm_rope_op:
            fp8 = self.simulate_quant and not self.rotate
            index_keys = self.simulate_quant and self.rotate  # then the Hadamard + FP4 rounding follows
            if not index_keys and store is not None:
                positions, cache, offset, seqs = store
                ops.rms_norm_rope_store(x, weight=self.norm.weight, cs=cs, eps=self.norm.eps, rope_dim=self.rope_dim,
                                        fp8_nope=fp8, positions=positions, ratio=self.ratio, offset=offset,
                                        slots=cache.shape[1] - offset, cache=cache, kv_batch=seqs)
                return None
            kv = ops.rms_norm_rope(x.unsqueeze(1), weight=self.norm.weight, cs=cs, eps=self.norm.eps,
                                   rope_dim=self.rope_dim, fp8_nope=fp8).squeeze(1)
            if not index_keys:
                return kv
        else:
            kv = apply_rope(self.norm(x), cs, self.rope_dim)
            if not self.simulate_quant:
                return kv
            if not self.rotate:
                return kv_fake_quant(kv, self.rope_dim)
        if decode and self.use_hadamard_op:
            return ops.hadamard_fp4(kv.unsqueeze(1), cs=None, rope_dim=0).squeeze(1)
        return indexer_fake_quant(kv)

    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, rope: torch.Tensor, start: torch.Tensor,
                fresh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, dim]: row b's tokens at positions start[b] .. start[b] + S - 1 (start int64 [B]; the state rows
        [:B] hold each row's tokens before start[b]: an earlier chunk's prefill, or decode), valid for the first
        lengths[b] (0: the row's state is left as it is, unless it starts at 0). Returns (entries
        [B, ceil(S / m), Dc], their indices start // m + w [B, ceil(S / m)]): every entry closed by a valid token,
        and after those junk ones (finite) that no valid query sees; sets the decode state of rows [:B] from each
        row's own length. Shapes do not depend on start. fresh: every start is 0 (the state is not read: nothing
        precedes position 0)."""
        B, S, _ = x.shape
        m, c, hd, dev = self.ratio, self.coff, self.head_dim, x.device
        kv, score = project(x, self.wkv, self.wgate)
        score = score + self.ape[(start.unsqueeze(1) + torch.arange(S, device=dev)) % m]
        # The tokens from the first window the chunk's entries read (m-aligned; with overlap one window earlier):
        # those before start from the state, then the chunk's (c*m + S cover every row's). Positions < 0 read as
        # kv 0 / score -inf whatever the state holds; chunk tokens past a row's length keep their (finite) values.
        first = (m * (start // m) - (c - 1) * m).unsqueeze(1)  # [B, 1]
        before = start.unsqueeze(1) - first  # tokens from the state, (c-1)*m .. c*m - 1
        j = torch.arange(c * m, device=dev).unsqueeze(0)
        # the state's rows: shifted (row j = position first + j) or indexed by position (spare > 0)
        srows = (first + j) % self.kv_state.shape[1] if self.spare else j.expand(B, -1)
        i = torch.arange(c * m + S, device=dev).unsqueeze(0)
        idx = torch.where(i < before, i, c * m + (i - before).clamp(max=S - 1))  # into [state rows, chunk]
        neg = (first + i < 0).unsqueeze(-1)

        def ext(v: torch.Tensor, state: torch.Tensor, fill: float) -> torch.Tensor:
            D = v.shape[-1]
            if fresh:  # the gather below with before = (c-1)*m, spelled as a cat: Inductor (2.11-2.13) fails on
                # the constant-folded clamp of its index ("'-4 + ((0))' is not comparable") in the overlap's cat
                return torch.cat([torch.full((B, (c - 1) * m, D), fill, device=dev), v,
                                  v[:, -1:].expand(-1, m, -1)], dim=1)
            # what earlier chunks left: constants here (no gradient flows into the state)
            rows = state[:B].detach().gather(1, srows.unsqueeze(-1).expand(-1, -1, D))
            both = torch.cat([rows, v], dim=1).gather(1, idx.expand(B, -1).unsqueeze(-1).expand(-1, -1, D))
            return torch.where(neg, torch.full((), fill, device=dev), both)

        kv, score = ext(kv, self.kv_state, 0.0), ext(score, self.score_state, float("-inf"))
        ext_len = before.squeeze(1) + lengths  # valid tokens from position `first` on
        rows = (lengths > 0) | (start == 0)  # a row from position 0 starts afresh even with no tokens
        if self.spare:  # the decode state
            self._prefill_state_by_position(kv, score, ext_len, first, rows)
        else:
            self._prefill_state(kv, score, ext_len, rows)

        n = -(-S // m)  # window c - 1 of the tokens is entry start // m; n windows hold every closed one
        kvw = kv[:, : (n + c - 1) * m].unflatten(1, (n + c - 1, m))
        scw = score[:, : (n + c - 1) * m].unflatten(1, (n + c - 1, m))
        if self.overlap:  # entry i: the first half of window i - 1's features, the second half of window i's
            kvw = torch.cat([kvw[:, :-1, :, :hd], kvw[:, 1:, :, hd:]], dim=2)
            scw = torch.cat([scw[:, :-1, :, :hd], scw[:, 1:, :, hd:]], dim=2)
        pooled = (kvw * scw.softmax(dim=2)).sum(dim=2)  # [B, n, Dc] fp32
        e = (start // m).unsqueeze(1) + torch.arange(n, device=dev)
        cs = rope[(e * m).clamp(max=rope.shape[0] - 1)]
        return self._finish(pooled, cs, x.dtype), e

    def _prefill_state(self, kv: torch.Tensor, score: torch.Tensor, lengths: torch.Tensor,
                       rows: torch.Tensor) -> None:
        """The decode state of rows [:B] where `rows` [B] (the others keep theirs: their prompt ended before
        the chunk) from each row's own length (tokens from an m-aligned position): overlap rows 0..m-1 = the
        last full window, rows m.. (or 0.. without overlap) = the pending tail."""
        B, S, _ = kv.shape
        m, c, hd = self.ratio, self.coff, self.head_dim
        n_full = (lengths // m).unsqueeze(1)  # [B, 1]
        r = torch.arange(c * m, device=kv.device).unsqueeze(0)
        if self.overlap:
            p = torch.where(r < m, m * (n_full - 1) + r, m * n_full + (r - m))
            valid = torch.where(r < m, n_full >= 1, p < lengths.unsqueeze(1))
        else:
            p = m * n_full + r
            valid = p < lengths.unsqueeze(1)
        gi = p.clamp(0, S - 1).unsqueeze(-1).expand(-1, -1, c * hd)
        vmask, keep = valid.unsqueeze(-1), ~rows.view(B, 1, 1)
        new_kv = torch.where(vmask, kv.gather(1, gi), torch.zeros((), device=kv.device))
        new_sc = torch.where(vmask, score.gather(1, gi), torch.full((), float("-inf"), device=kv.device))
        self.kv_state[:B] = torch.where(keep, self.kv_state[:B], new_kv)
        self.score_state[:B] = torch.where(keep, self.score_state[:B], new_sc)

    def _prefill_state_by_position(self, kv: torch.Tensor, score: torch.Tensor, lengths: torch.Tensor,
                                   first: torch.Tensor, rows: torch.Tensor) -> None:
        """The position-indexed state of rows [:B] where `rows` [B] (as _prefill_state; token t of row b of kv /
        score at position first[b] + t, first [B, 1]): row p % R <-
        position p for the last R positions before first + lengths[b]; rows whose latest such position is
        before `first` keep what they hold (decode reads at most c*m - 1 positions back, none of those), rows of
        positions < 0 are cleared."""
        B, S, _ = kv.shape
        R = self.kv_state.shape[1]
        s = torch.arange(R, device=kv.device).unsqueeze(0)
        last = first + (lengths - 1).unsqueeze(1)
        p = s + R * torch.div(last - s, R, rounding_mode="floor")  # the latest position < first + length in row s
        t = p - first
        gi = t.clamp(0, S - 1).unsqueeze(-1).expand(-1, -1, kv.shape[-1])
        ok, neg = ((t >= 0) & rows.unsqueeze(1)).unsqueeze(-1), ((p < 0) & rows.unsqueeze(1)).unsqueeze(-1)
        old_kv = torch.where(neg, torch.zeros((), device=kv.device), self.kv_state[:B])
        old_sc = torch.where(neg, torch.full((), float("-inf"), device=kv.device), self.score_state[:B])
        self.kv_state[:B] = torch.where(ok, kv.gather(1, gi), old_kv)
        self.score_state[:B] = torch.where(ok, score.gather(1, gi), old_sc)

    def decode(self, x: torch.Tensor, step: DecodeStep | TokenSteps, rope_kind: str,
               proj: tuple[torch.Tensor, torch.Tensor] | None = None, store=None):
        """x [B, dim] = token at the step's positions[b], or T tokens per row (step: TokenSteps; x [T * B, dim], row
        t * B + b at steps[t]: one op call advances each row's state token after token, then the T * B pooled windows
        go through _finish at once, store's seqs = B); rope_kind: the RoPE table of its layer. Updates state rows
        [:B]; returns (entries [rows, Dc] for window positions//m, complete [rows] bool: whether that window closed
        at the row's token). proj: (wkv(x), wgate(x)) if already computed (Attention runs both compressors'
        projections in one launch). store: (positions, cache, offset, seqs), where the fused op can write that
        cache: entries are None when they were written into cache already (_finish)."""
        kv, score = project(x, self.wkv, self.wgate) if proj is None else proj
        one = step if isinstance(step, DecodeStep) else step.stacked
        seqs = 0 if one is step else x.shape[0] // len(step)
        complete = (one.positions + 1) % self.ratio == 0
        return self._finish(self._advance(kv, score, one.positions, seqs), one.cs(rope_kind, self.ratio), x.dtype,
                            store), complete

    def _advance(self, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor, seqs: int = 0) -> torch.Tensor:
        """Each row's token into the state; its window pooled -> [rows, hd] where it closes ((positions + 1) % m ==
        0: the entry; 0 where it stays open, nothing pooled); seqs: the rows are tokens of that many sequences, each
        advancing its state in order. The op rounds the pooling to x's dtype itself (_finish's .to(dtype) is then no kernel); a state of
        c*m + spare rows (spare > 0) is indexed by position: the op pools a closed window in the same order and
        arithmetic as the shifted state, so a model with spare slots computes the plain model's entries."""
        pooled = torch.empty(kv.shape[0], self.head_dim, dtype=self.pooled_dtype, device=kv.device)
        ops.compressor_decode(kv, score, ape=self.ape, positions=positions, kv_state=self.kv_state,
                              score_state=self.score_state, pooled=pooled, kv_batch=seqs)
        return pooled
