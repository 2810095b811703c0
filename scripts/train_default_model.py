"""Train the built-in default model: a tiny DeepSeek-V4 on the Python standard library's source.

One command, time-bounded (the whole run, set-up and save included, stays within --minutes):

    python scripts/train_default_model.py --out out/default_model --minutes 8 --device cuda

Writes into --out: the checkpoint (``dsv4_model.checkpoint.loader.save_model``: dsv4 layout, routed experts stored as
MXFP4 like the official release, everything else bf16 / fp32 as the official release stores it),
``config.json``, ``tokenizer.json``, ``heldout_sample.txt`` (a fixed text cut from held-out files; the CI
perplexity test reads it), ``train_log.json`` and ``loss_curve.png`` (when matplotlib is importable).

The model is the project's own ``dsv4_model.model.Transformer``, driven through its per-block ``prefill``
with gradients on; fp32 master weights, bf16 autocast on CUDA, AdamW, linear warm-up + cosine decay.
Beyond next-token cross-entropy the run trains what the inference model has but a plain LM loss cannot reach:
  * the lightning indexers (top-k selection has no gradient): KL distillation of the main attention's
    distribution over the compressed entries into the indexer scores (DeepSeek-V3.2 DSA recipe),
  * the MTP block: cross-entropy on the token after next (weight --mtp-weight),
  * router balance of the learned MoE layers: auxiliary-loss-free bias updates (DeepSeek-V3),
  * the routed experts' MXFP4 storage: quantization-aware training (straight-through fake quant) from
    --qat-start of the schedule on, so the stored 4-bit experts are the weights the model was tuned with.
The schedule (cosine, QAT start, end) follows the share of the time budget used, so the run ends on time and
annealed whatever the speed (capped at --max-epochs); --steps N makes it step-based and repeatable instead (the
log records the steps a timed run made).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_data as td  # noqa: E402

# Seconds kept back from the budget for the final evaluations, the sample and the save.
_RESERVE_S = 30.0
_CALIBRATION_START, _CALIBRATION_END = 5, 25


# -------------------------------------------------------------------------------------------------
# Model configurations
# -------------------------------------------------------------------------------------------------

def default_config_fields(vocab_size: int) -> dict:
    """17.1M parameters (~19 MB stored), every layer kind of DeepSeek-V4 at small scale.

    Layers: 0 SWA-only, 1 CSA(4) + indexer, 2 HCA(16), 3 CSA, 4 HCA, 5 CSA; MTP block SWA-only (trailing 0).
    Layers 0-1 hash-routed, 2-5 and MTP learned routers. HCA's ratio is 16 instead of 128 so a 512-token
    context crosses 32 compression boundaries; CSA's top-k (32) is below its 128 entries at 512 tokens, so the
    indexer's selection is real. Storage (bytes): embed+head 4.2M bf16, routed experts 18.9M params as MXFP4
    5.0M, attention 3.6M, compressors 1.5M, mHC 1.2M fp32, shared experts 1.2M, MTP 2.0M.
    """
    return dict(
        vocab_size=vocab_size,
        dim=256,
        n_layers=6,
        n_heads=4,
        head_dim=128,
        rope_head_dim=64,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        window_size=64,
        compress_ratios=[0, 4, 16, 4, 16, 4, 0],
        index_n_heads=8,
        index_head_dim=64,
        index_topk=32,
        moe_inter_dim=128,
        n_routed_experts=16,
        n_shared_experts=1,
        n_activated_experts=2,
        route_scale=1.0,
        n_hash_layers=2,
        swiglu_limit=10.0,
        hc_mult=4,
        n_mtp_layers=1,
        max_position_embeddings=4096,  # trained on 512-token windows; informational
        expert_dtype="fp4",  # informational, as the official config: routed experts are stored MXFP4
        bos_token_id=td.BOS_ID,
        eos_token_id=td.EOS_ID,
    )


def micro_config_fields(vocab_size: int) -> dict:
    """Seconds on a CPU, same layer kinds (the tests use it)."""
    f = default_config_fields(vocab_size)
    f.update(dim=64, n_layers=3, n_heads=2, head_dim=128, q_lora_rank=32, o_groups=1, o_lora_rank=32,
             window_size=16, compress_ratios=[0, 4, 8, 0], index_n_heads=8, index_head_dim=64, index_topk=4,
             moe_inter_dim=32, n_routed_experts=4, n_activated_experts=2, n_hash_layers=1)
    return f


CONFIGS = {"default": default_config_fields, "micro": micro_config_fields}


def make_config(fields: dict):
    from dsv4_model.model.config import ModelConfig

    return ModelConfig(**fields).validate()


def build_model(cfg, batch_size: int, seq_len: int, device: torch.device, simulate_quant: bool = False):
    from dsv4_model.model.transformer import Transformer

    return Transformer(cfg, max_batch_size=batch_size, max_seq_len=seq_len, dtype=torch.float32, device=device,
                       simulate_quant=simulate_quant)


# -------------------------------------------------------------------------------------------------
# Differentiable full-sequence forward.
# Transformer.prefill is @torch.no_grad (inference entry point); its per-block prefill is plain autograd-able
# PyTorch, so training drives the blocks directly, exactly as Transformer.prefill does.
# -------------------------------------------------------------------------------------------------

def forward_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, S] ids from position 0 -> final residual streams [B, S, hc, dim]."""
    B, S = ids.shape
    return model.streams(ids, torch.full((B,), S, dtype=torch.long, device=ids.device))


def logits_from_hidden(model, h: torch.Tensor) -> torch.Tensor:
    return model._logits(h)


def forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S, vocab] logits of every position."""
    return logits_from_hidden(model, forward_hidden(model, ids))


def mtp_logits(model, h: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """MTP depth 1 (dsv4_model.model.mtp.prefill): position t combines the main streams h_t with the embedding of
    token t+1 and predicts token t+2. h [B, T, hc, d], next_ids [B, T] (tokens 1..T) -> logits [B, T, V]."""
    from dsv4_model.model import mtp

    return mtp.prefill(model, h, next_ids)[0]


@torch.no_grad()
def detach_runtime_buffers(model) -> None:
    """Prefill writes caches / compressor state in place; under autograd those buffers would keep every
    step's graph alive (the loss never reads them, so backward never frees it). Cut them loose."""
    for b in model.buffers():
        if b.grad_fn is not None:
            b.detach_()


# -------------------------------------------------------------------------------------------------
# Initialisation (the inference model allocates parameters without initialising them)
# -------------------------------------------------------------------------------------------------

def _logit(p: float) -> float:
    return math.log(p / (1 - p))


@torch.no_grad()
def init_parameters(model, cfg, seed: int) -> list[str]:
    """Initialise every parameter by its official name; returns the names that matched no rule."""
    gen = torch.Generator().manual_seed(seed)
    hc = cfg.hc_mult
    std = 0.02
    out_std = std / math.sqrt(2 * (cfg.n_layers + cfg.n_mtp_layers))
    unmatched = []

    def normal_(p, s):
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(s).to(p.dtype))

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if (leaf == "weight" and p.dim() == 1) or name.endswith("norm.weight"):
            p.fill_(1.0)
        elif "hc_" in leaf and leaf.endswith("_fn"):
            normal_(p, std)
        elif "hc_" in leaf and leaf.endswith("_scale"):
            p.fill_(0.1)
        elif leaf == "hc_head_base":
            p.fill_(_logit(1.0 / hc))  # collapse = mean of the streams
        elif "hc_" in leaf and leaf.endswith("_base"):
            # [pre (hc) | post (hc) | comb (hc*hc)]: pre averages the streams, post = 2*sigmoid(0) = 1, comb
            # near the identity so the streams do not start as copies of each other.
            p.zero_()
            p[:hc] = _logit(1.0 / hc)
            p[2 * hc:] = torch.eye(hc).flatten() * 4.0
        elif leaf in ("attn_sink", "ape", "bias"):
            p.zero_()
        elif name.endswith(("wo_b.weight", "w2.weight", "experts.w2")):
            normal_(p, out_std)
        elif p.dim() >= 2 and p.is_floating_point():
            normal_(p, std)
        else:
            unmatched.append(name)
    return unmatched


@torch.no_grad()
def init_hash_tables(model, seed: int) -> None:
    """tid2eid: a fixed random table, distinct experts in every row (a token never picks one expert twice)."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            n_experts = model.config.n_routed_experts
            rows = torch.rand(buf.shape[0], n_experts, generator=gen).argsort(dim=1)
            buf.copy_(rows[:, : buf.shape[1]].to(buf.dtype))


def trainable_parameters(model):
    """Everything floating except the router biases (set by the balance rule, not by gradients)."""
    out = []
    for name, p in model.named_parameters():
        train = p.is_floating_point() and not name.endswith("gate.bias")
        p.requires_grad_(train)
        if train:
            out.append((name, p))
    return out


# -------------------------------------------------------------------------------------------------
# Router balance: auxiliary-loss-free bias update (DeepSeek-V3): bias_e += gamma * sign(mean load - load_e)
# -------------------------------------------------------------------------------------------------

class RouterBalancer:
    def __init__(self, model):
        from dsv4_model.model.moe import Gate

        self.gates = [g for g in model.modules() if isinstance(g, Gate) and not g.hash]
        self.active = True
        self.last: dict = {}
        for g in self.gates:
            g.register_buffer("_load", torch.zeros(g.weight.shape[0], device=g.weight.device), persistent=False)
            g.register_forward_hook(self._hook)

    def _hook(self, gate, args, out):
        if self.active and torch.is_grad_enabled():
            idx = out[1].detach().flatten()
            gate._load.index_add_(0, idx, torch.ones(idx.shape, device=idx.device))

    @torch.no_grad()
    def update(self, gamma: float) -> None:
        for g in self.gates:
            load = g._load
            g.bias.add_(gamma * torch.sign(load.mean() - load))
            self.last[g] = load.clone()
            load.zero_()

    @torch.no_grad()
    def imbalance(self) -> list[float]:
        """max/mean expert load per learned layer in the last step (1.0 = perfectly balanced)."""
        return [round(float(v.max() / v.mean().clamp_min(1e-9)), 3) for v in self.last.values()]


# -------------------------------------------------------------------------------------------------
# Indexer distillation (CSA layers): KL(main attention over compressed entries || indexer distribution).
# -------------------------------------------------------------------------------------------------

class IndexerDistill:
    """Wraps each CSA Attention's prefill to compute, on the side, the indexer's training loss.

    Target: the main heads' softmax over the visible compressed entries (head-summed, renormalised),
    computed without gradient. Prediction: softmax of the indexer score over the same entries, recomputed from
    DETACHED inputs so that this loss trains the indexer (its q projection, weights_proj and compressor) only.
    """

    def __init__(self, model):
        from dsv4_model.model.attention import Attention

        self.layers = [m for m in model.modules() if isinstance(m, Attention) and m.indexer is not None]
        self.active = False
        self.losses: list[torch.Tensor] = []
        for attn in self.layers:
            self._wrap(attn)

    def _wrap(self, attn) -> None:
        # prefill is a method, not the module's forward (no forward hook sees it): wrap it on the instance
        prefill = attn.prefill

        def wrapped(x, lengths, rope, at):
            out = prefill(x, lengths, rope, at)
            n = at.span // attn.ratio  # the compressed entries a query of the chunk can see
            if self.active and torch.is_grad_enabled() and at.fresh and n:
                self.losses.append(self._loss(attn, x, lengths, rope, n))
            return out

        attn.prefill = wrapped

    @staticmethod
    def _ste_fp4(x: torch.Tensor) -> torch.Tensor:
        """Hadamard + FP4 rounding as the inference indexer applies it, with a straight-through gradient."""
        from dsv4_model.model.quant_sim import fp4_e2m1_block_fake_quant, hadamard_rotate

        r = hadamard_rotate(x)
        return r + (fp4_e2m1_block_fake_quant(r) - r).detach()

    def _loss(self, attn, x, lengths, rope, n) -> torch.Tensor:
        """x [B, S, dim] from position 0 (forward_hidden), every row S tokens long; n entries visible at most."""
        idx = attn.indexer
        B, S, _ = x.shape
        t = torch.arange(S, device=x.device)
        vis = torch.arange(n, device=x.device)[None, :] < ((t + 1) // attn.ratio)[:, None]  # [S, n]
        rows = vis.any(-1)
        xd = x.detach()
        start = torch.zeros(B, dtype=torch.long, device=x.device)
        # the main attention's queries and entries as its prefill computed them: the same calls, with gradients
        # tracked as there (fp32_linear picks its kernel by that), give the same bits; the compressor rewrites its
        # state with what it holds
        qr, q, _, _ = attn._qkv(xd, rope[:S])
        comp = attn.compressor.prefill(xd, lengths, rope, start, fresh=True)[0][:, :n]
        qr, q, comp = qr.detach(), q.detach(), comp.detach()
        with torch.no_grad():
            s = torch.einsum("bshd,bnd->bshn", q.float(), comp.float()) * attn.softmax_scale
            p = s.masked_fill(~vis[None, :, None], float("-inf")).softmax(-1).nan_to_num(0.0).sum(2)
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        # recompute the indexer's inputs from detached activations, rounding with a straight-through gradient
        sim = idx.simulate_quant
        idx.simulate_quant = idx.compressor.simulate_quant = False
        try:
            keys = idx.compressor.prefill(xd, lengths, rope, start, fresh=True)[0][:, :n]  # the closed windows' entries
            iq = idx.queries(qr, rope[:S].unsqueeze(-3))
        finally:
            idx.simulate_quant = idx.compressor.simulate_quant = sim
        if sim:
            keys, iq = self._ste_fp4(keys), self._ste_fp4(iq)
        # a large finite fill, not -inf: rows with nothing visible would give NaN gradients through log_softmax
        sc = idx.scores(iq, xd, keys).float().masked_fill(~vis[None], -1e9)
        logq = sc.log_softmax(-1).masked_fill(~vis[None], 0.0)
        kl = (p * (torch.log(p.clamp_min(1e-12)) - logq)).sum(-1)  # [B, S]
        return kl[:, rows].mean()

    def pop_loss(self) -> torch.Tensor | None:
        if not self.losses:
            return None
        loss = torch.stack(self.losses).mean()
        self.losses = []
        return loss


# -------------------------------------------------------------------------------------------------
# Regularisation: dropout on every attention and MoE output (the corpus is small; training runs many epochs)
# -------------------------------------------------------------------------------------------------

class SublayerDropout:
    """Forward hooks on each MoE and on each attention's output projection wo_b (whose output is the attention's:
    Attention._out ends with it) that replace the output by its dropout while training."""

    def __init__(self, model, p: float):
        from dsv4_model.model.attention import Attention
        from dsv4_model.model.moe import MoE

        self.p = p
        self.active = False
        for mod in model.modules():
            if isinstance(mod, Attention):
                mod.wo_b.register_forward_hook(self._drop)
            elif isinstance(mod, MoE):
                mod.register_forward_hook(self._drop)

    def _drop(self, module, args, out: torch.Tensor) -> torch.Tensor | None:
        if self.active and self.p > 0 and torch.is_grad_enabled():
            return F.dropout(out, self.p, training=True)
        return None  # the output as it is


# -------------------------------------------------------------------------------------------------
# MXFP4 routed experts: quantization-aware training + storage
# -------------------------------------------------------------------------------------------------

class MXFP4FakeQuant(nn.Module):
    """Round stacked expert weights [E, out, in] to MXFP4 (e2m1, one power-of-two scale per 32 along `in`,
    scale = amax/6 rounded up) with a straight-through gradient. Identity while disabled. The rule equals
    `dsv4_model.quant.formats.quant_mxfp4`, so storing the rounded weights with it is exact."""

    def __init__(self):
        super().__init__()
        self.enabled = False

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return w
        return w + (mxfp4_round(w) - w).detach()


def mxfp4_round(w: torch.Tensor) -> torch.Tensor:
    from dsv4_model.model.quant_sim import pow2_ceil, round_to_e2m1

    *lead, n_in = w.shape
    wb = w.float().reshape(*lead, n_in // 32, 32)
    scale = pow2_ceil((wb.abs().amax(-1, keepdim=True) / 6.0).clamp_min(2.0 ** -100))
    return (round_to_e2m1((wb / scale).clamp(-6.0, 6.0)) * scale).reshape(w.shape).to(w.dtype)


def add_expert_qat(model) -> list[MXFP4FakeQuant]:
    from dsv4_model.model.moe import Experts

    fqs = []
    for mod in model.modules():
        if isinstance(mod, Experts):
            for name in ("w1", "w2", "w3"):
                fq = MXFP4FakeQuant()
                parametrize.register_parametrization(mod, name, fq, unsafe=True)
                fqs.append(fq)
    return fqs


def remove_expert_qat(model) -> None:
    from dsv4_model.model.moe import Experts

    for mod in model.modules():
        if isinstance(mod, Experts) and parametrize.is_parametrized(mod):
            for name in ("w1", "w2", "w3"):
                parametrize.remove_parametrizations(mod, name, leave_parametrized=True)


def storage_state_dict(model) -> dict[str, torch.Tensor]:
    """The tensors to store, with official storage formats: routed experts per expert as MXFP4 (int8 codes +
    E8M0 scales), fp32 where the official release keeps fp32 (mHC, sinks, ape, router bias), bf16 elsewhere."""
    from dsv4_model.checkpoint.names import expert_name, is_stacked_expert_name, official_storage
    from dsv4_model.quant.formats import quant_mxfp4

    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if is_stacked_expert_name(name):
            for e in range(t.shape[0]):
                packed, scale = quant_mxfp4(t[e].float())
                key = expert_name(name, e)
                out[key] = packed.contiguous()
                out[key[: -len("weight")] + "scale"] = scale.contiguous()
        elif t.is_floating_point():
            out[name] = t.to(torch.float32 if official_storage(name) == "f32" else torch.bfloat16).contiguous()
        else:
            out[name] = t.contiguous()
    return out


class _StoredModel:
    """What `save_model` needs from a model: a state_dict (here, the storage tensors)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def state_dict(self):
        return self._state


# -------------------------------------------------------------------------------------------------
# Training
# -------------------------------------------------------------------------------------------------

def _snapshot(model) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps times a cosine from `peak` to `floor * peak` over progress 0..1."""
    p = min(1.0, max(0.0, progress))
    return peak * min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def param_groups(named_params, weight_decay: float):
    decay, no_decay = [], []
    for name, p in named_params:
        (decay if p.dim() >= 2 and "hc_" not in name.rsplit(".", 1)[-1] else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


_AUTOCAST = {"on": True, "off": False, "auto": None}
_autocast_mode: bool | None = None  # None: bf16 autocast on CUDA only


def autocast_for(device: torch.device):
    on = device.type == "cuda" if _autocast_mode is None else _autocast_mode
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """Mean next-token cross-entropy (nats) over [n, seq+1] windows."""
    total, count = 0.0, 0
    with parametrize.cached():
        for i in range(0, windows.shape[0], batch_size):
            w = windows[i: i + batch_size].to(device)
            with autocast_for(device):
                logits = forward_logits(model, w[:, :-1])
            total += float(F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
            count += w[:, 1:].numel()
    return total / max(1, count)


@torch.no_grad()
def greedy_sample(model, tok, prompt: str, n_new: int, device: torch.device, max_ctx: int) -> str:
    """Greedy continuation by re-running the full-sequence forward (a smoke check of what was learnt)."""
    ids = torch.tensor([tok.encode(prompt).ids], device=device)
    with parametrize.cached():
        for _ in range(n_new):
            with autocast_for(device):
                logits = forward_logits(model, ids[:, -max_ctx:])
            nxt = logits[:, -1].float().argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if int(nxt) == td.EOS_ID:
                break
    return tok.decode(ids[0].tolist())


def plot_losses(log: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in log["train"]], [r["loss"] for r in log["train"]], label="train", lw=0.8)
    if any("mtp_loss" in r for r in log["train"]):
        ax.plot([r["step"] for r in log["train"]], [r.get("mtp_loss") for r in log["train"]],
                label="train, MTP (token after next)", lw=0.6, alpha=0.7)
    if log["val"]:
        ax.plot([r["step"] for r in log["val"]], [r["loss"] for r in log["val"]], "o-", label="validation")
    if log.get("qat_step") is not None:
        ax.axvline(log["qat_step"], color="gray", ls="--", lw=0.8, label="MXFP4 QAT on")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"default model: {log['params']/1e6:.1f}M params, {log['tokens_seen']/1e6:.1f}M tokens")
    ax.set_yscale("log")  # the first steps start at ln(vocab); the interesting part is far below
    fmt = matplotlib.ticker.FormatStrFormatter("%.1f")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the whole run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="default")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--tokenizer", type=Path, help="reuse this tokenizer.json instead of training one")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--dropout", type=float, default=0.1, help="on attention and MoE outputs")
    ap.add_argument("--max-epochs", type=float, default=40.0, help="cap of the auto schedule, in train-set epochs")
    ap.add_argument("--steps", type=int, help="fixed schedule length (default: fill the time budget)")
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--indexer-weight", type=float, default=1.0)
    ap.add_argument("--balance-gamma", type=float, default=1e-3, help="router bias step per training step")
    ap.add_argument("--qat-start", type=float, default=0.3, help="fraction of the schedule where MXFP4 QAT starts")
    ap.add_argument("--autocast", choices=sorted(_AUTOCAST), default="auto",
                    help="bf16 autocast (auto: on CUDA only; 'on' on a CPU rehearses the GPU run's dtypes)")
    ap.add_argument("--simulate-quant", action="store_true",
                    help="train with the inference QAT numerics (FP8 KV, FP4 indexer; straight-through)")
    ap.add_argument("--eval-every", type=float, default=30.0, help="seconds between validation evaluations")
    ap.add_argument("--eval-windows", type=int, default=128, help="validation/test windows of --seq-len tokens")
    ap.add_argument("--sample-chars", type=int, default=24000, help="size of the shipped held-out sample")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-files", type=int, help="use only the first N train files (quick tests)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    global _autocast_mode
    args = parse_args(argv)
    _autocast_mode = _AUTOCAST[args.autocast]
    t_start = time.perf_counter()
    budget_s = args.minutes * 60.0
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")

    def elapsed():
        return time.perf_counter() - t_start

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # ---- data + tokenizer
    files = td.list_stdlib_files()
    split = td.split_files(files)
    if args.max_files:
        split["train"] = split["train"][: args.max_files]
    texts = {k: td.read_texts(v) for k, v in split.items()}
    if args.tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.tokenizer))
    else:
        tok = td.train_tokenizer(texts["train"], args.vocab_size)
    streams = {k: td.encode_documents(tok, v) for k, v in texts.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heldout_sample.txt").write_text(td.heldout_sample(texts["test"], args.sample_chars))
    print(f"[data] {len(files)} stdlib files from {td.stdlib_root()}: "
          + ", ".join(f"{k} {len(split[k])} files / {streams[k].numel():,} tokens" for k in split)
          + f"; vocab {tok.get_vocab_size()}; {elapsed():.1f}s", flush=True)

    # ---- model
    cfg = make_config(CONFIGS[args.config](tok.get_vocab_size()))
    model = build_model(cfg, args.batch_size, args.seq_len, device, args.simulate_quant)
    unmatched = init_parameters(model, cfg, args.seed)
    init_hash_tables(model, args.seed)
    if unmatched:
        print(f"[init] left as allocated: {unmatched}", flush=True)
    fqs = add_expert_qat(model)
    named = trainable_parameters(model)
    balancer = RouterBalancer(model)
    distill = IndexerDistill(model)
    dropout = SublayerDropout(model, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] {n_params/1e6:.2f}M parameters; config {args.config}; device {device}; "
          f"{len(distill.layers)} indexers, {len(balancer.gates)} learned routers, MTP {cfg.n_mtp_layers}", flush=True)
    indexer_ids = {id(p) for a in distill.layers for p in a.indexer.parameters()}
    main_params = [p for _, p in named if id(p) not in indexer_ids]
    indexer_params = [p for _, p in named if id(p) in indexer_ids]

    opt_kwargs = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if device.type == "cuda":
        opt_kwargs["fused"] = True
    opt = torch.optim.AdamW(param_groups(named, args.weight_decay), **opt_kwargs)

    sampler = td.WindowSampler(streams["train"], args.batch_size, args.seq_len, args.seed, device=device)
    val_windows = td.eval_windows(streams["val"], args.seq_len, args.eval_windows)
    test_windows = td.eval_windows(streams["test"], args.seq_len, args.eval_windows)

    log = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "python": sys.version.split()[0], "torch": torch.__version__, "device": str(device),
           "config": cfg.to_dict(), "params": n_params,
           "data": {k: {"files": len(split[k]), "tokens": int(streams[k].numel())} for k in split},
           "train": [], "val": [], "tokens_seen": 0, "qat_step": None}

    # ---- train
    # Progress runs 0 -> 1 and drives the cosine, the QAT start and the end: by step count with --steps
    # (repeatable), else by the share of the time budget used (evaluations included, so the schedule ends on time
    # even if the speed drifts), capped by --max-epochs.
    cap_steps = max(1, int(args.max_epochs * streams["train"].numel() / (args.batch_size * args.seq_len)))
    best = (float("inf"), None, -1)  # best validation of the QAT phase: what gets stored
    best_any = (float("inf"), None, -1)  # before QAT: only a fallback after an error
    last_eval = time.perf_counter()
    step = 0
    tokens_per_step = args.batch_size * args.seq_len
    t_train = time.perf_counter()
    train_budget = max(1.0, budget_s - _RESERVE_S - elapsed())
    qat_on = False

    def progress() -> float:
        if args.steps:
            return step / args.steps
        return max((time.perf_counter() - t_train) / train_budget, step / cap_steps)

    model.train()
    try:
        while True:
            prog = progress()
            if args.steps and elapsed() > budget_s - _RESERVE_S:
                print(f"[train] time budget reached at step {step} of {args.steps}", flush=True)
                break
            if prog >= 1.0:
                print(f"[train] schedule done at step {step} ({'steps' if args.steps else 'time / epoch cap'})",
                      flush=True)
                break
            if not qat_on and prog >= args.qat_start:
                for fq in fqs:
                    fq.enabled = True
                qat_on = True
                log["qat_step"] = step
                print(f"[train] step {step}: MXFP4 QAT of the routed experts on", flush=True)
            lr = lr_at(step, prog, args.lr, args.warmup)
            for g in opt.param_groups:
                g["lr"] = lr

            batch = sampler.next()
            distill.active = args.indexer_weight > 0
            dropout.active = True
            with autocast_for(device), parametrize.cached():
                h = forward_hidden(model, batch[:, :-1])
                logits = logits_from_hidden(model, h)
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
                total = loss
                mtp_loss = idx_loss = None
                if cfg.n_mtp_layers and args.mtp_weight > 0:
                    ml = mtp_logits(model, h[:, :-1], batch[:, 1:-1])
                    mtp_loss = F.cross_entropy(ml.float().flatten(0, 1), batch[:, 2:].flatten())
                    total = total + args.mtp_weight * mtp_loss
                idx_loss = distill.pop_loss()
                if idx_loss is not None:
                    total = total + args.indexer_weight * idx_loss
                elif distill.active and distill.layers:
                    raise RuntimeError("indexer distillation produced no loss: no CSA attention prefill from "
                                       "position 0 saw a compressed entry")
            distill.active = dropout.active = False
            detach_runtime_buffers(model)
            opt.zero_grad(set_to_none=True)
            total.backward()
            # separate clipping: the indexer's distillation gradients must not shrink the language model's steps
            gnorm = torch.nn.utils.clip_grad_norm_(main_params, 1.0)
            if indexer_params:
                torch.nn.utils.clip_grad_norm_(indexer_params, 1.0)
            opt.step()
            balancer.update(args.balance_gamma)  # uses this step's loads, then clears them
            step += 1
            log["tokens_seen"] += tokens_per_step

            if step % args.log_every == 0 or step <= 3 or step == args.steps:
                rec = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": gnorm.item(), "time": elapsed(),
                       "progress": round(prog, 4)}
                if mtp_loss is not None:
                    rec["mtp_loss"] = mtp_loss.item()
                if idx_loss is not None:
                    rec["indexer_kl"] = idx_loss.item()
                log["train"].append(rec)
                tps = log["tokens_seen"] / (time.perf_counter() - t_train)
                extra = "".join(f" {k} {rec[k]:.3f}" for k in ("mtp_loss", "indexer_kl") if k in rec)
                print(f"[train] step {step}{'/' + str(args.steps) if args.steps else ''} loss {rec['loss']:.4f}{extra} "
                      f"lr {lr:.2e} gnorm {rec['grad_norm']:.2f} {tps:,.0f} tok/s t={elapsed():.0f}s", flush=True)
                if not math.isfinite(rec["loss"]):
                    raise FloatingPointError(f"non-finite loss at step {step}")

            if step == _CALIBRATION_START:
                sync()
                t_calib = time.perf_counter()
            if step == _CALIBRATION_END:
                sync()
                per_step = (time.perf_counter() - t_calib) / (_CALIBRATION_END - _CALIBRATION_START)
                est = min(cap_steps, int(train_budget / per_step)) if not args.steps else args.steps
                log["calibration"] = {"ms_per_step": per_step * 1e3, "tokens_per_s": tokens_per_step / per_step,
                                      "projected_steps": est}
                print(f"[train] {per_step * 1e3:.0f} ms/step, {tokens_per_step / per_step:,.0f} tok/s -> about {est} "
                      f"steps ({est * tokens_per_step / 1e6:.0f}M tokens, "
                      f"{est * tokens_per_step / streams['train'].numel():.1f} epochs)", flush=True)

            if time.perf_counter() - last_eval > args.eval_every and len(val_windows):
                vl = evaluate(model, val_windows, args.batch_size, device)
                log["val"].append({"step": step, "loss": vl, "ppl": math.exp(vl), "time": elapsed(),
                                   "router_max_over_mean": balancer.imbalance()})
                print(f"[eval] step {step} val loss {vl:.4f} ppl {math.exp(vl):.3f}", flush=True)
                if qat_on and vl < best[0]:
                    best = (vl, _snapshot(model), step)
                elif not qat_on and vl < best_any[0]:
                    best_any = (vl, _snapshot(model), step)
                last_eval = time.perf_counter()
    except Exception:
        # Keep what was learnt (the run costs GPU time): fall back to the best validated weights.
        log["error"] = traceback.format_exc()
        print(f"[train] stopped by an error at step {step}:\n{log['error']}", flush=True)
        if best[1] is None and best_any[1] is None:
            raise
        model.load_state_dict(best[1] if best[1] is not None else best_any[1])

    # ---- final: keep the best validation checkpoint of the QAT phase (a small corpus: late steps may overfit)
    model.eval()
    log["steps"] = step
    log["train_seconds"] = time.perf_counter() - t_train
    log["tokens_per_second"] = log["tokens_seen"] / max(1e-9, log["train_seconds"])
    if len(val_windows):
        vl = evaluate(model, val_windows, args.batch_size, device)
        log["val"].append({"step": step, "loss": vl, "ppl": math.exp(vl), "time": elapsed()})
        print(f"[eval] final step {step} val loss {vl:.4f} ppl {math.exp(vl):.3f}", flush=True)
        if best[1] is not None and best[0] < vl:
            model.load_state_dict(best[1])
            print(f"[eval] keeping step {best[2]} (val loss {best[0]:.4f})", flush=True)
            log["kept_step"] = best[2]
        else:
            log["kept_step"] = step
    for fq in fqs:  # what is stored is MXFP4 whatever the schedule did
        fq.enabled = True
    remove_expert_qat(model)
    if len(test_windows):
        tl = evaluate(model, test_windows, args.batch_size, device)
        log["test"] = {"loss": tl, "ppl": math.exp(tl), "tokens": int(test_windows[:, 1:].numel()),
                       "note": "fp32 weights (experts MXFP4-rounded), bf16 autocast on CUDA, simulate_quant="
                               f"{args.simulate_quant}"}
        print(f"[eval] test loss {tl:.4f} ppl {math.exp(tl):.3f} over {log['test']['tokens']:,} tokens", flush=True)
    try:
        log["sample"] = greedy_sample(model, tok, "import os\n\n\ndef ", 48, device, args.seq_len)
        print("[sample]\n" + log["sample"], flush=True)
    except Exception as e:  # a smoke check only: never lose the checkpoint over it
        log["sample_error"] = repr(e)

    from dsv4_model.checkpoint.loader import save_model

    # Shards under 15 MB: the GPU machine hands back files of at most 16 MiB each.
    save_model(_StoredModel(storage_state_dict(model)), cfg, args.out, max_shard_bytes=15 * 2**20)
    tok.save(str(args.out / "tokenizer.json"))
    log["wall_seconds"] = elapsed()
    log["plot"] = plot_losses(log, args.out / "loss_curve.png")
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"[done] wrote {args.out} ({size / 1e6:.1f} MB) in {elapsed():.0f}s total", flush=True)
    return log


if __name__ == "__main__":
    main()
