"""DeepSeek-V4 transformer (pure PyTorch) with preallocated caches and a compile-friendly decode step.

Parameter names = official checkpoint names (dsv4_model/checkpoint/names.py maps the others), except routed
experts, which are stacked: layers.N.ffn.experts.w1 / w3 [E, inter, dim] and w2 [E, dim, inter].
`ffn.gate.tid2eid` is a persistent int64 buffer. Caches and RoPE tables are non-persistent buffers (re)built by
`setup_runtime(device)`.

Parameter dtypes follow the official model: fp32 for norms, mHC params, attn_sink, compressor (ape, wkv, wgate),
router bias and head.weight (logits are computed in fp32; narrow_weights_ holds the head and compressor weights in
bf16 when their values fit, as released); the model dtype for everything else. A loader must
copy each checkpoint tensor into the existing parameter (cast to param.dtype).

Numerics follow the official inference/model.py. Where transformers 5.23 (DeepseekV4ForCausalLM) differs
(tests/test_model_hf_parity.py shows fp32 parity with simulate_quant=False, max |diff| ~1e-6):
  * no QAT simulation: no FP8 rounding of KV nope dims, no Hadamard + FP4 on indexer q / keys
    (our simulate_quant=False reproduces that; True is the official behaviour);
  * a hash row of tid2eid naming an expert twice: HF adds it twice (index_add_), official once (see moe.py);
    HF's default init sets tid2eid to all zeros, so parity configs give every row distinct experts;
  * indexer top-k tie order is implementation-defined in HF (torch.topk); ours is fixed (attention.py);
  * reduced-precision only (identical in fp32): HF runs compressor projections / pooling product, hc_post,
    the routed-expert weighting (after w2, accumulated in bf16) and lm_head in the model dtype; official uses fp32
    there (fp32 logits from an fp32 head). Official computes indexer scores in bf16; we (and HF) use fp32.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_ops import ops, supports

from dsv4_model.model.attention import Attention, PrefillAt
from dsv4_model.model.checks import check_max_seq_len, check_positive_int
from dsv4_model.model.compressor import Compressor
from dsv4_model.model.indexer import Indexer
from dsv4_model.model.decode_options import DEFAULT as DEFAULT_OPTIONS, DecodeOptions
from dsv4_model.model.step_values import DecodeStep, StepScratch, TokenSteps
from dsv4_model.model.to_device import to_device
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.layers import (Linear, RMSNorm, hc_head, hc_post, hc_pre, narrow_if_lossless_, rope_inv_freq,
                                     rope_table)
from dsv4_model.model.moe import MoE
from dsv4_model.model.row_copy import RowMoves


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Pending(NamedTuple):
    """A sublayer's output not yet folded into the hc streams: out [B, dim] (or, with ids, an NVFP4 MoE's
    uncombined expert rows, nvfp4_moe_rows) and its hc_post mixes."""

    out: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    ids: torch.Tensor | None = None  # the rows' top-k expert ids
    n_experts: int = 0


class HcSite(NamedTuple):
    """One sublayer's mHC mix (Block.hc_attn / hc_ffn): its weights (the Block's hc_<site>_fn / scale / base, the
    checkpoint's names), the sublayer's norm, and whether dsv4::hc_pre takes fn (op: asked at setup)."""

    fn: torch.Tensor
    scale: torch.Tensor
    base: torch.Tensor
    norm: RMSNorm
    op: bool


def fuses_post(site: HcSite, out_dtype: torch.dtype, h_dtype: torch.dtype, opts: DecodeOptions) -> bool:
    """Whether Block._post_pre_normed folds a sublayer output of out_dtype into streams of h_dtype with one
    dsv4::hc_post_pre call (supports.hc_post_pre: the dtypes equal, and its fn check, site.op, asked at setup)."""
    return not torch.is_grad_enabled() and opts.hc_pre and site.op and out_dtype == h_dtype


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, max_batch: int, max_seq_len: int):
        super().__init__()
        self.layer_id = layer_id
        self.hc = cfg.hc_mult
        self.iters, self.hc_eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps
        self.attn = Attention(cfg, layer_id, dtype, max_batch, max_seq_len)
        self.ffn = MoE(cfg, layer_id, dtype)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        mix, hc_dim = (2 + self.hc) * self.hc, self.hc * cfg.dim
        # named as the checkpoints name them (dsv4_model/checkpoint/names.py); read through hc_attn / hc_ffn
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _param(mix, hc_dim), _param(mix), _param(3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _param(mix, hc_dim), _param(mix), _param(3)
        self.ask_supports()

    def ask_supports(self) -> None:
        """Whether dsv4::hc_pre takes each sublayer's fn (supports.hc_pre): it depends only on how fn is stored, so
        it is asked here (at construction, and again by Transformer.setup_runtime after the weights are loaded),
        not in every step."""
        self.hc_attn_op = supports.hc_pre(self.hc_attn_fn)
        self.hc_ffn_op = supports.hc_pre(self.hc_ffn_fn)

    # Built on each use from the parameters (no reference kept that a reload or move could leave stale).
    @property
    def hc_attn(self) -> HcSite:
        return HcSite(self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.attn_norm, self.hc_attn_op)

    @property
    def hc_ffn(self) -> HcSite:
        return HcSite(self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.ffn_norm, self.hc_ffn_op)

    def _pre(self, h: torch.Tensor, site: HcSite):
        return hc_pre(h, site.fn, site.scale, site.base, self.hc, self.iters, self.hc_eps, self.norm_eps)

    def prefill(self, h: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, rope: dict, at: PrefillAt,
                static_moe: bool = False) -> torch.Tensor:
        x, post, comb = self._pre(h, self.hc_attn)
        h = hc_post(self.attn.prefill(self.attn_norm(x), lengths, rope[self.attn.rope_kind], at), h, post, comb)
        x, post, comb = self._pre(h, self.hc_ffn)
        return hc_post(self.ffn(self.ffn_norm(x), ids, static=static_moe), h, post, comb)

    def _pre_normed(self, h: torch.Tensor, site: HcSite, opts: DecodeOptions):
        """_pre, then the sublayer's norm: at decode one dsv4::hc_pre call (unless opts say otherwise)."""
        norm = site.norm
        if not torch.is_grad_enabled() and opts.hc_pre and site.op:
            return ops.hc_pre(h, fn=site.fn, scale=site.scale.float(), base=site.base.float(),
                              norm_weight=norm.weight.float(), iters=self.iters, hc_eps=self.hc_eps,
                              norm_eps=self.norm_eps, out_eps=norm.eps)
        x, post, comb = self._pre(h, site)
        return norm(x), post, comb

    def _post_pre_normed(self, h: torch.Tensor, pending: "Pending | None", site: HcSite, opts: DecodeOptions):
        """hc_post of pending (the previous sublayer's output, or None) into the streams h, then _pre_normed:
        one dsv4::hc_post_pre call where fuses_post, and always for a MoE's uncombined expert rows (which only
        that call can fold). Returns (h, x, post, comb)."""
        if pending is not None and (pending.ids is not None or fuses_post(site, pending.out.dtype, h.dtype, opts)):
            norm = site.norm
            return ops.hc_post_pre(pending.out, h, pending.post, pending.comb, fn=site.fn, scale=site.scale.float(),
                                   base=site.base.float(), norm_weight=norm.weight.float(), iters=self.iters,
                                   hc_eps=self.hc_eps, norm_eps=self.norm_eps, out_eps=norm.eps,
                                   out_ids=pending.ids, out_experts=pending.n_experts)
        if pending is not None:
            h = hc_post(pending.out, h, pending.post, pending.comb)
        return (h, *self._pre_normed(h, site, opts))

    def decode(self, h: torch.Tensor, ids: torch.Tensor, step: "DecodeStep | list[DecodeStep]",
               pending: "Pending | None" = None, fold_rows: bool = False,
               routed: torch.Tensor | None = None) -> "tuple[torch.Tensor, Pending]":
        """One token per row (step: a DecodeStep), or T (step: T DecodeSteps; rows t * B + b of h / ids: token t
        of sequence b; every op on all rows where the rings have T - 1 spare slots, else attention token after
        token: Attention.decode_tokens).
        pending: the previous block's ffn output not yet folded into the streams h (its hc_post runs fused with
        this block's first hc_pre); returns (h, pending) the same way. fold_rows: the next block's hc_post_pre can
        sum an NVFP4 MoE's expert rows, so they go to it uncombined (one combine kernel less per layer; the
        Transformer decides). routed: the rows whose tokens go to their routed experts (MoE.forward; None: all)."""
        opts = step.options if isinstance(step, DecodeStep) else step[0].options
        h, x, post, comb = self._post_pre_normed(h, pending, self.hc_attn, opts)
        out = self.attn.decode(x, step) if isinstance(step, DecodeStep) else self.attn.decode_tokens(x, step)
        h, x, post, comb = self._post_pre_normed(h, Pending(out, post, comb), self.hc_ffn, opts)
        if fold_rows:
            rows = self.ffn.decode_rows(x, ids, routed)
            if rows is not None:
                return h, Pending(rows[0], post, comb, rows[1], rows[2])
        return h, Pending(self.ffn(x, ids, static=True, routed=routed), post, comb)


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


def draft_head(model: "Transformer") -> nn.Module:
    """The head the drafters (MTP block, DSpark) read: the model's own, or the one attach_draft_head gave it (e.g.
    NVFP4: a quarter of the bytes per speculative step; verification keeps the model's head, so greedy output and
    the sampled distribution are unchanged, only how often drafts are accepted)."""
    return model.__dict__.get("draft_head") or model.head


def attach_draft_head(model: "Transformer", head: nn.Module | None) -> None:
    """Give the model a drafters' head (fp32 logits of [..., dim]), or None for its own; a plain attribute, not a
    submodule: the model's state dict and module walks stay the checkpoint's."""
    object.__setattr__(model, "draft_head", head)


def head_logits(h: torch.Tensor, owner: nn.Module, head: Linear, cfg: ModelConfig) -> torch.Tensor:
    """Streams [..., hc, dim] -> fp32 logits through the collapse (hc_head_*) and norm of `owner` (the
    Transformer, or an MTP block) and the shared head (a Linear(fp32=True))."""
    y = hc_head(h, owner.hc_head_fn, owner.hc_head_scale, owner.hc_head_base, cfg.hc_eps, cfg.norm_eps)
    # fp32 logits of y (bf16 in a bf16 model) and the head as stored (bf16 once narrowed): exact products
    # summed in fp32, the head read as it is (no fp32 copy of it per call)
    return head(owner.norm(y))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, *, max_batch_size: int = 1, max_seq_len: int = 4096,
                 dtype: torch.dtype = torch.bfloat16, device=None, simulate_quant: bool = True,
                 prefill_attn_rows: int | None = None, allow_beyond_max_position: bool = False,
                 spare_window_slots: int = 0):
        super().__init__()
        # the drafters' own head (attach_draft_head), None: the model's. Present from the start, so a compiled step
        # that read it guards on it and recompiles when a head is attached later.
        attach_draft_head(self, None)
        config.validate()
        check_positive_int(max_batch_size, "max_batch_size")
        check_max_seq_len(max_seq_len, config, allow_beyond_max_position)
        if simulate_quant:
            if (config.head_dim - config.rope_head_dim) % 64:
                raise ValueError("simulate_quant needs head_dim - rope_head_dim to be a multiple of 64 "
                                 f"(got {config.head_dim} - {config.rope_head_dim})")
            if 4 in config.compress_ratios and (config.index_head_dim % 32
                                                or config.index_head_dim & (config.index_head_dim - 1)):
                raise ValueError("simulate_quant needs index_head_dim to be a power of two >= 32 "
                                 f"(got {config.index_head_dim})")
        self.config = config
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.dtype = dtype
        self.hc = config.hc_mult
        ctx = torch.device(device) if device is not None else contextlib.nullcontext()
        with ctx:
            self.embed = Embedding(config.vocab_size, config.dim, dtype)
            self.layers = nn.ModuleList(Block(config, i, dtype, max_batch_size, max_seq_len)
                                        for i in range(config.n_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.head = Linear(config.dim, config.vocab_size, torch.float32, fp32=True)
            self.hc_head_fn = _param(config.hc_mult, config.hc_mult * config.dim)
            self.hc_head_base = _param(config.hc_mult)
            self.hc_head_scale = _param(1)
            from dsv4_model.model.mtp import MTPBlock  # here: mtp.py builds on this module's Block

            self.mtp = nn.ModuleList(MTPBlock(config, config.n_layers + i, dtype, max_batch_size, max_seq_len)
                                     for i in range(config.n_mtp_layers))
        self.set_simulate_quant(simulate_quant)
        self.set_prefill_attn_rows(prefill_attn_rows)
        if not isinstance(spare_window_slots, int) or spare_window_slots < 0:
            raise ValueError(f"spare_window_slots must be an int >= 0, got {spare_window_slots!r}")
        self.spare_window_slots = spare_window_slots
        for a in self.modules():
            if isinstance(a, Attention):  # window rings of W + spare slots (docs/speculation.md)
                a.ring = a.window + spare_window_slots
            elif isinstance(a, Compressor):  # compressor states indexed by position
                a.spare = spare_window_slots
        if self.embed.weight.device.type != "meta":
            self.setup_runtime()

    # ------------------------------------------------------------------ runtime state
    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def set_simulate_quant(self, on: bool) -> None:
        self.simulate_quant = bool(on)
        for mod in self.modules():
            if isinstance(mod, (Attention, Compressor, Indexer)):
                mod.simulate_quant = self.simulate_quant

    def set_prefill_attn_rows(self, rows: int | None) -> None:
        """Query rows per prefill attention block (None: by memory, Attention.prefill_rows)."""
        if rows is not None:
            check_positive_int(rows, "prefill_attn_rows")
        for mod in self.modules():
            if isinstance(mod, Attention):
                mod.prefill_attn_rows = None if rows is None else int(rows)

    def setup_runtime(self, device=None) -> None:
        """(Re)build the non-persistent buffers (RoPE tables, caches) on `device` (default: the params' device).
        Call after `to_empty(device=...)` + loading weights, or after moving the model."""
        device = torch.device(device) if device is not None else self.device
        self._drop_row_caches()  # (new buffers)
        c = self.config
        main = rope_inv_freq(c.rope_head_dim, c.rope_theta)
        comp = rope_inv_freq(c.rope_head_dim, c.compress_rope_theta, c.original_seq_len, c.rope_factor,
                             c.beta_fast, c.beta_slow)
        self.register_buffer("rope_main", rope_table(main, self.max_seq_len, device), persistent=False)
        self.register_buffer("rope_compress", rope_table(comp, self.max_seq_len, device), persistent=False)
        # A decode step's values every layer reads, written once per step into buffers (step_values.StepScratch):
        # gathered into plain tensors instead, Inductor would recompute each into a copy for every custom op that
        # reads it (one kernel per layer and use). The attended-rows keys: the layers without an indexer's
        # (ring slots, ratio, entries), and the window rows alone (ring slots, 0, 0) that CSA layers pass beside
        # their top-k.
        attn_keys = sorted({(a.ring, a.ratio, a.n_entries) if a.indexer is None else (a.ring, 0, 0)
                            for a in self.modules() if isinstance(a, Attention)})
        # rows for a step of max_batch tokens, or of the T <= spare + 1 tokens per row a verification decodes at once
        rows = self.max_batch_size * (1 + self.spare_window_slots)
        self.step_scratch = StepScratch(rows, c.rope_head_dim, c.compress_ratios, attn_keys, device)
        for mod in self.modules():
            if isinstance(mod, Block):
                mod.ask_supports()
            elif isinstance(mod, Attention):
                mod.alloc_runtime(device, self.dtype)
            elif isinstance(mod, Indexer):
                mod.alloc_runtime(device, self.dtype)
            elif isinstance(mod, Compressor):
                mod.alloc_runtime(device, self.dtype)

    @torch.no_grad()
    def narrow_weights_(self, lossless: bool | None = None) -> "Transformer":
        """Hold the fp32-math weights that only carry bf16 values in bf16 (layers.narrow_if_lossless_: the same
        results, half the bytes per decode step): the compressors' projections and the head (V4-Flash: 1 GB less
        read every step). The loader calls it after loading."""
        for mod in self.modules():
            if isinstance(mod, Compressor):
                mod.narrow_weights_(lossless)
        narrow_if_lossless_(self.head, lossless)
        return self

    @torch.no_grad()
    def reset_caches(self) -> None:
        """Zero every cache / state (not needed for correctness: prefill rewrites what decode reads)."""
        for mod in self.modules():
            if isinstance(mod, Compressor):
                mod.reset_state()
            elif isinstance(mod, Attention):
                mod.kv_cache.zero_()
            elif isinstance(mod, Indexer):
                for buf in (mod.kv_cache, mod.k_codes, mod.k_scales):
                    buf.zero_()

    CACHE_SUFFIXES = ("kv_cache", "k_codes", "k_scales", "kv_state", "score_state")

    def row_state_buffers(self) -> list[torch.Tensor]:
        """Every buffer that holds a cache row's state: the caches and compressor states, an attached DSpark module's
        rings too (attached, not a submodule)."""
        return self._buffers_named(self.CACHE_SUFFIXES)

    def _buffers_named(self, suffixes: tuple[str, ...]) -> list[torch.Tensor]:
        """The buffers (this model's and an attached DSpark module's) whose names end with one of `suffixes`. Where
        they live is found once per setup_runtime and attached DSpark module (a module walk costs ~1 ms at 43
        layers; the scheduler moves rows several times per step); the tensors are read from there on every call."""
        dspark = getattr(self, "dspark", None)
        epoch = getattr(dspark, "_runtime_epoch", 0)
        held = self.__dict__.setdefault("_buffer_slots", {}).get(suffixes)
        if held is None or held[0] is not dspark or held[1] != epoch:
            seen, slots = set(), []
            for mod in (*self.modules(), *(dspark.modules() if dspark is not None else ())):
                for name, buf in mod._buffers.items():
                    if buf is not None and name.endswith(suffixes) and id(buf) not in seen:
                        seen.add(id(buf))
                        slots.append((mod, name))
            held = self.__dict__["_buffer_slots"][suffixes] = (dspark, epoch, slots)
        bufs = (mod._buffers.get(name) for mod, name in held[2])
        return [buf for buf in bufs if buf is not None]

    def _row_moves(self, what: str) -> RowMoves:
        return self.__dict__.setdefault(f"_row_moves_{what}", RowMoves())

    def _drop_row_caches(self) -> None:
        """Forget where the row-state buffers live and the row views made of them (they hold the old tensors):
        setup_runtime and moves (.to(), to_empty) make new ones."""
        for name in ("_buffer_slots", "_row_moves_rows", "_row_moves_states"):
            self.__dict__.pop(name, None)

    def _apply(self, fn, recurse=True):
        self._drop_row_caches()
        return super()._apply(fn, recurse)

    @torch.no_grad()
    def swap_rows_(self, a: list[int], b: list[int]) -> None:
        """Exchange cache rows a[i] and b[i] in every row-state buffer (the scheduler brings the rows of a prefill
        chunk down to rows [:k] and back, so the chunk computes k rows, not every row below the highest)."""
        self._row_moves("rows").swap(self.row_state_buffers(), a, b)

    @torch.no_grad()
    def copy_rows_(self, src: list[int], dst: list[int]) -> None:
        """Cache row src[i] -> row dst[i] in every row-state buffer: the scheduler keeps a prompt's state at a
        prefix in a free row, and later prompts that share the prefix continue from a copy of it."""
        self._row_moves("rows").copy(self.row_state_buffers(), src, dst)

    def compressor_ratios(self) -> set[int]:
        return {mod.ratio for mod in self.modules() if isinstance(mod, Compressor)}

    _COMPRESSOR_STATES = ("kv_state", "score_state")

    @torch.no_grad()
    def save_compressor_rows(self, rows: list[int]) -> list[torch.Tensor]:
        """Copies of every compressor state's rows `rows` (restore_compressor_rows puts them back)."""
        return self._row_moves("states").save(self._buffers_named(self._COMPRESSOR_STATES), rows)

    @torch.no_grad()
    def restore_compressor_rows(self, rows: list[int], saved: list[torch.Tensor]) -> None:
        self._row_moves("states").restore(self._buffers_named(self._COMPRESSOR_STATES), rows, saved)

    def cache_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n.endswith(self.CACHE_SUFFIXES))

    def scratch_buffer_names(self) -> list[str]:
        """Buffers a decode step writes before it reads them (not state carried between steps)."""
        return [f"step_scratch.{n}" for n, _ in self.step_scratch.named_buffers()]

    def _rope(self) -> dict:
        return {"main": self.rope_main, "compress": self.rope_compress}

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final streams [..., hc, dim] -> fp32 logits."""
        return head_logits(h, self, self.head, self.config)

    # ------------------------------------------------------------------ inference entry points
    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                all_logits: bool = False, static_moe: bool = False, start: "int | torch.Tensor" = 0,
                span: int | None = None, layer_call: Callable | None = None) -> torch.Tensor:
        """Forward `tokens` [B, S] at positions start .. start + S - 1 and fill cache rows [:B]. start: an int, or
        int64 [B] per row; > 0: a chunk of a longer prompt (the rows' caches hold their positions before start,
        from earlier chunks or decode steps; the result is what one prefill of the whole prompt gives).
        span: an int >= every row's start + lengths (default: start + S for an int start, max_seq_len for a
        tensor; a tensor start's padded tokens may run past it): with a tensor start the graph's shapes depend on
        S and span only, not on the starts.

        lengths [B] (optional): right-padded rows; row b is valid for its first lengths[b] tokens and its cache
        state ends there (0: a row with nothing in this chunk, left as it is). Returns fp32 logits [B, V] at the
        token lengths[b]-1 (default S-1; junk where lengths[b] == 0), or [B, S, V].
        static_moe: float experts through their static-shape path (gathering each token's expert weights: what
        torch.export can trace; memory grows with tokens x top-k x expert size) instead of the per-expert loop
        with data-dependent shapes. layer_call(layer, h, ids, lengths, rope, at, static_moe): runs one layer's
        prefill (a compiled region; default: layer.prefill)."""
        B, S = tokens.shape
        tokens = to_device(tokens, self.device)
        if lengths is None:
            lengths = torch.full((B,), S, dtype=torch.long, device=self.device)
        lengths = to_device(lengths.long(), self.device)
        h = self.streams(tokens, lengths, static_moe, start, span, layer_call=layer_call)
        if all_logits:
            return self._logits(h)
        last = h[torch.arange(B, device=self.device), (lengths - 1).clamp(min=0)]
        return self._logits(last)

    def streams(self, tokens: torch.Tensor, lengths: torch.Tensor, static_moe: bool = False,
                start: "int | torch.Tensor" = 0, span: int | None = None,
                before_layer: Callable | None = None, layer_call: Callable | None = None) -> torch.Tensor:
        """The main layers over `tokens` [B, S] from position start (as prefill's; filling cache rows [:B]) -> the
        final residual streams [B, S, hc, dim] before the head's collapse (what prefill's logits and the MTP block
        read). before_layer(layer_id, h): sees each layer's input streams (DSpark reads its target layers').
        layer_call: as prefill's. Tracks gradients where enabled (training)."""
        at = self.prefill_at(tokens.shape, start, span)
        rope = self._rope()
        h = self.embed(tokens).unsqueeze(2).repeat(1, 1, self.hc, 1)
        for layer in self.layers:
            if before_layer is not None:
                before_layer(layer.layer_id, h)
            if layer_call is None:
                h = layer.prefill(h, tokens, lengths, rope, at, static_moe)
            else:
                h = layer_call(layer, h, tokens, lengths, rope, at, static_moe)
        return h

    def prefill_at(self, shape: torch.Size, start: "int | torch.Tensor", span: int | None) -> PrefillAt:
        """A checked PrefillAt for a chunk of `shape` (B, S) (prefill's start / span)."""
        B, S = shape
        fresh, bound = False, None
        if isinstance(start, torch.Tensor):
            if start.shape != (B,) or start.dtype != torch.long:
                raise ValueError(f"prefill start must be an int or int64 [{B}], got {start.dtype} "
                                 f"{tuple(start.shape)}")
            starts, span = to_device(start, self.device), self.max_seq_len if span is None else span
        elif isinstance(start, int) and not isinstance(start, bool) and start >= 0:
            starts, fresh, bound = torch.full((B,), start, dtype=torch.long, device=self.device), start == 0, start
            span = start + S if span is None else span
            if not isinstance(span, int) or span < start + S:
                raise ValueError(f"prefill span must be an int >= start + S = {start + S}, got {span!r}")
        else:
            raise ValueError(f"prefill start must be an int >= 0 or an int64 tensor, got {start!r}")
        if B > self.max_batch_size or S < 1 or not isinstance(span, int) or not S <= span <= self.max_seq_len:
            where = f"from position {start}" if isinstance(start, int) else f"span {span}"
            raise ValueError(f"prefill shape {(B, S)} {where} exceeds max_batch_size={self.max_batch_size} / "
                             f"max_seq_len={self.max_seq_len}")
        return PrefillAt(starts, span, fresh, bound)

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor,
                    options: DecodeOptions = DEFAULT_OPTIONS, layer_call: Callable | None = None) -> torch.Tensor:
        """One token per row: tokens [B] at positions [B] (device tensors; B <= max_batch_size) -> fp32 [B, V].
        options: how the step is built (dsv4_model.model.decode_options). layer_call(layer, h, ids, step, pending,
        fold_rows): runs one layer's decode (a compiled region; default: layer.decode).

        Static shapes, no host syncs: safe for torch.compile(fullgraph=True) and CUDA graphs."""
        step = DecodeStep(positions, options, self._rope(), *self.step_scratch.slots())
        h = self.embed(tokens).unsqueeze(1).repeat(1, self.hc, 1)
        return self._logits(self._decode_layers(h, tokens, step, options, layer_call))

    def _decode_layers(self, h, tokens, step, options, layer_call=None) -> torch.Tensor:
        """The main layers' decode of streams h (step: one DecodeStep, or T of them) -> the final streams."""
        pending = None
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            fold = nxt is not None and fuses_post(nxt.hc_attn, torch.bfloat16, h.dtype, options)
            if layer_call is None:
                h, pending = layer.decode(h, tokens, step, pending, fold_rows=fold)
            else:
                h, pending = layer_call(layer, h, tokens, step, pending, fold)
        return hc_post(pending.out, h, pending.post, pending.comb)

    @torch.no_grad()
    def decode_tokens(self, tokens: torch.Tensor, positions: torch.Tensor,
                      options: DecodeOptions = DEFAULT_OPTIONS) -> torch.Tensor:
        """T tokens per row from any position: tokens [B, T] at positions [B] .. positions + T - 1 (each row's
        cache holds its positions before) -> fp32 logits [B, T, V]; the caches then hold the T tokens too. What T
        decode steps give, with each weight read once for the T tokens (a speculative step's verification, a
        prompt continued in chunks; docs/speculation.md). Static shapes, no host syncs."""
        B, T = tokens.shape
        h = self._decode_tokens_streams(tokens, positions, options)
        return self._logits(h).view(T, B, -1).transpose(0, 1)

    def _decode_tokens_streams(self, tokens: torch.Tensor, positions: torch.Tensor,
                               options: DecodeOptions) -> torch.Tensor:
        """decode_tokens' final streams [T * B, hc, dim], row t * B + b: token t of row b (mtp.verify_tokens
        also returns them, for the MTP block)."""
        T = tokens.shape[1]
        ids = tokens.t().reshape(-1)
        h = self.embed(ids).unsqueeze(1).repeat(1, self.hc, 1)
        return self._decode_layers(h, ids, self._token_steps(positions, T, options), options)

    def _token_steps(self, positions: torch.Tensor, T: int, options: DecodeOptions,
                     scratch: bool = True) -> TokenSteps:
        """T tokens per row; their stacked step's shared values in the step scratch where its rows hold T * B
        (a verification), else (or scratch=False) tensors of their own. One writer of the scratch per graph: the
        MTP block's steps after a verification pass scratch=False (a slot written again after its readers would
        reach each of them as a fresh copy, step_values)."""
        fits = scratch and T * positions.shape[0] <= self.step_scratch.rows
        return TokenSteps(positions, T, options, self._rope(), self.step_scratch if fits else None)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self.prefill(tokens, lengths, all_logits=True)

    def shard_experts_(self, shard) -> "Transformer":
        """Expert parallelism: keep this rank's slice of every MoE layer's routed experts (an
        `dsv4_model.model.parallel.ExpertShard`); the other weights stay replicated. An attached DSpark module
        (`model.dspark`, not a submodule) is sharded too."""
        for mod in self.modules():
            if isinstance(mod, MoE):
                mod.shard_experts_(shard)
        if getattr(self, "dspark", None) is not None:
            self.dspark.shard_experts_(shard)
        return self
