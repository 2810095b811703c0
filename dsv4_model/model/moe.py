"""Mixture of experts: sqrt-softplus router (bias for selection only / hash routing), clamped SwiGLU experts.

Routed experts are stored STACKED: experts.w1 / w3 [E, inter, dim], experts.w2 [E, dim, inter].

Repeated experts: a hash-routing row of tid2eid may name the same expert twice. The official MoE does
`y[idx] += expert(x[idx], w)` with duplicate rows in `idx`, and index_put without accumulate keeps ONE of the
(identical) contributions, so a repeated expert counts once, with the weight it got from normalising over all k
picks (duplicates included in the denominator). We reproduce that by zeroing the weight of every later duplicate.
(transformers 5.23 uses index_add_ and counts it twice.)

How the experts compute is the MoE's `backend`, a stateless strategy naming the child modules it reads:
`FloatExperts` (this module: `experts` + `shared_experts`, float weights) or the NVFP4 one that the conversion
installs (dsv4_model.quant.quantize_model: one `nvfp4` module). `MoE.swap_backend_` exchanges them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_ops import ops, supports

from dsv4_model.model.config import ModelConfig
from dsv4_model.model.layers import Linear, fp32_linear
from dsv4_model.model.parallel import ExpertShard


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.topk = cfg.n_activated_experts
        self.score_func = cfg.score_func
        self.route_scale = cfg.route_scale
        self.hash = layer_id < cfg.n_hash_layers
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim, dtype=dtype), requires_grad=False)
        if self.hash:
            self.register_buffer("tid2eid", torch.empty(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.long))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.empty(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim], ids [N] -> (weights [N, k] fp32, indices [N, k] long)."""
        logits = fp32_linear(x, [self.weight])[0]
        if self.score_func == "sqrtsoftplus" and not self.hash and supports.router_topk(logits, self.topk):
            # the score function inside the op's kernel too (one kernel for scores, selection and weights)
            return ops.router_topk(logits, bias=self.bias, k=self.topk, renormalize=True, scale=self.route_scale,
                                   sqrt_softplus=True)
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        renorm = self.score_func != "softmax"
        if not self.hash and supports.router_topk(scores, self.topk):
            # one kernel instead of topk's two, the gather and the renormalisation (the op has no backward)
            return ops.router_topk(scores, bias=self.bias, k=self.topk, renormalize=renorm, scale=self.route_scale)
        if self.hash:
            indices = self.tid2eid[ids].long()
        else:
            indices = (scores + self.bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        if renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, indices


def _swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    g, u = g.float(), u.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u


class Expert(nn.Module):
    """Shared expert (same SwiGLU as the routed ones, no routing weight)."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype, limit: float):
        super().__init__()
        self.w1 = Linear(dim, inter, dtype)
        self.w2 = Linear(inter, dim, dtype)
        self.w3 = Linear(dim, inter, dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class Experts(nn.Module):
    """Routed experts, stacked: w1 / w3 [E, inter, d], w2 [E, d, inter]."""

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        E, d = n_experts, dim
        self.n_experts = E
        self.limit = limit
        self.w1 = nn.Parameter(torch.empty(E, inter, d, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(E, inter, d, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, d, inter, dtype=dtype), requires_grad=False)

    def narrow_(self, start: int, count: int) -> None:
        """Keep experts [start, start + count) only (expert parallelism)."""
        for r in ("w1", "w2", "w3"):
            setattr(self, r, nn.Parameter(getattr(self, r)[start:start + count].clone(), requires_grad=False))
        self.n_experts = count

    def forward_loop(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Eager per-expert loop (data-dependent shapes; prefill). Returns fp32 [N, dim]."""
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        counts = torch.bincount(indices.flatten(), weights=(weights != 0).flatten().float(),
                                minlength=self.n_experts).tolist()
        for e in range(self.n_experts):
            if counts[e] == 0:
                continue
            tok, kpos = torch.where((indices == e) & (weights != 0))
            xe = x[tok]
            h = _swiglu(F.linear(xe, self.w1[e]), F.linear(xe, self.w3[e]), self.limit)
            h = weights[tok, kpos, None] * h
            y.index_add_(0, tok, F.linear(h.to(x.dtype), self.w2[e]).float())
        return y

    def forward_gather(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Static-shape path (decode): gather each (token, k) expert's weights and batch-matmul."""
        w1 = self.w1[indices]  # [N, k, inter, d]
        w3 = self.w3[indices]
        w2 = self.w2[indices]  # [N, k, d, inter]
        g = torch.einsum("nd,nkid->nki", x, w1)
        u = torch.einsum("nd,nkid->nki", x, w3)
        h = weights.unsqueeze(-1) * _swiglu(g, u, self.limit)
        out = torch.einsum("nki,nkdi->nkd", h.to(x.dtype), w2)
        return out.float().sum(dim=1)


def dedup_weights(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Zero the weight of every repeat of an expert within a row (keeps the first occurrence)."""
    k = indices.shape[-1]
    same = indices.unsqueeze(-1) == indices.unsqueeze(-2)  # [N, k, k]
    earlier = torch.ones(k, k, dtype=torch.bool, device=indices.device).tril(-1)
    dup = (same & earlier).any(dim=-1)
    return torch.where(dup, torch.zeros_like(weights), weights)


class ExpertsBackend(Protocol):
    """How an MoE's experts compute, on the child modules named in `modules`."""

    modules: tuple[str, ...]
    quantized: bool

    def combined(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 static: bool) -> torch.Tensor:
        """Routed + shared experts' output [N, dim] in x's dtype; static: no data-dependent shapes."""

    def rows_dtype(self, moe: "MoE") -> torch.dtype | None:
        """The input dtype for which `rows` gives the uncombined bf16 rows, or None (asked when installed)."""

    def rows(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Each assignment's expert output before the combine, bf16 [N*k (+ N), dim] (dsv4::nvfp4_moe_rows)."""

    def narrow_(self, moe: "MoE", start: int, count: int) -> None:
        """Keep routed experts [start, start + count) only (expert parallelism)."""


class FloatExperts:
    """Float weights: the routed experts stacked in `experts` (an eager per-expert loop in prefill, a gather +
    batched matmul at static shapes), the shared expert in `shared_experts`."""

    modules = ("experts", "shared_experts")
    quantized = False

    def combined(self, moe, x, weights, indices, static):
        run = moe.experts.forward_gather if static else moe.experts.forward_loop
        if moe.shard is None:
            return (run(x, weights, indices) + moe.shared_experts(x).float()).to(x.dtype)
        # another rank's assignments weigh 0 here (expert 0 stands in): the fp32 partial sums add up across ranks
        local, ids = moe.local_ids(indices)
        y = moe.shard.all_reduce(run(x, torch.where(local, weights, 0.0), torch.where(local, ids, 0)))
        return (y + moe.shared_experts(x).float()).to(x.dtype)

    def rows_dtype(self, moe):
        return None

    def rows(self, moe, x, weights, indices):
        raise NotImplementedError("float experts give combined outputs only")

    def narrow_(self, moe, start, count):
        moe.experts.narrow_(start, count)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.dim = cfg.dim
        self.n_experts = cfg.n_routed_experts
        self.gate = Gate(cfg, layer_id, dtype)
        self.experts = Experts(cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit, dtype)
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, dtype, cfg.swiglu_limit)
        self.backend: ExpertsBackend = FloatExperts()
        self.rows_dtype = self.backend.rows_dtype(self)  # decode_rows' input dtype (None: no rows)
        self.shard: ExpertShard | None = None  # expert parallelism: this rank's experts (shard_experts_)
        self.expert_start = 0

    def shard_experts_(self, shard: ExpertShard) -> None:
        """Keep this rank's slice of the routed experts (dsv4_model.model.parallel); forward then sums the ranks'
        contributions. Routing stays global (every rank routes every token alike)."""
        if self.shard is not None:
            raise ValueError("the experts are sharded already")
        start, count = shard.bounds(self.n_experts)
        self.backend.narrow_(self, start, count)
        self.shard, self.expert_start = shard, start

    def local_ids(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(whether each assignment's expert is on this rank, its index among this rank's experts)."""
        ids = indices - self.expert_start
        return (ids >= 0) & (ids < self.n_experts // self.shard.world), ids

    def swap_backend_(self, backend: ExpertsBackend, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """Install `backend` with its child `modules` (named as backend.modules); returns the previous backend's
        modules, removed from this one (the NVFP4 conversion and its inverse)."""
        if set(modules) != set(backend.modules):
            raise ValueError(f"{type(backend).__name__} takes modules {backend.modules}, got {tuple(modules)}")
        old = {name: self._modules.pop(name) for name in self.backend.modules}
        for name, mod in modules.items():
            self.add_module(name, mod)
        self.backend = backend
        self.rows_dtype = backend.rows_dtype(self)
        return old

    def _route(self, x: torch.Tensor, ids: torch.Tensor,
               routed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        weights, indices = self.gate(x, ids.reshape(-1))
        if self.gate.hash:  # a hash table row may repeat an expert; a top-k selection never does
            weights = dedup_weights(weights, indices)
        if routed is not None:
            # a token whose output nobody reads (a speculative step's positions past its cut) goes to no expert:
            # id -1, which the expert kernels skip (no weight read for it), and weight 0 for the float paths
            keep = routed.reshape(-1, 1)
            weights, indices = torch.where(keep, weights, 0.0), torch.where(keep, indices, -1)
        return weights, indices

    def decode_rows(self, x: torch.Tensor, ids: torch.Tensor, routed: torch.Tensor | None = None):
        """Decode (x [B, 1, dim]): the experts' uncombined rows for dsv4::hc_post_pre as (rows [B*k (+ B), dim],
        topk ids [B, k], n_experts), or None where the backend gives no bf16 rows (float experts, a model of
        another dtype): the caller then takes forward's combined output. routed: as forward's."""
        if x.dtype != self.rows_dtype:
            return None
        x = x.reshape(-1, self.dim)
        weights, indices = self._route(x, ids, routed)
        return self.backend.rows(self, x, weights, indices), indices, self.n_experts

    def forward(self, x: torch.Tensor, ids: torch.Tensor, static: bool = False,
                routed: torch.Tensor | None = None) -> torch.Tensor:
        """routed [tokens] bool (None: all): the tokens that go to their experts; the others get the shared
        expert's output only, and no routed expert's weights are read for them."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, indices = self._route(x, ids, routed)
        return self.backend.combined(self, x, weights, indices, static).view(shape)
