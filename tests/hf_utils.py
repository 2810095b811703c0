"""Helpers for parity tests against transformers' DeepseekV4ForCausalLM (tiny random models, CPU, fp32)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from dsv4_model.model.config import ModelConfig


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny-tensor tests: OpenMP fan-out only costs time (badly so on a shared 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_config(**overrides) -> ModelConfig:
    """Tiny config that crosses many window / compression boundaries within ~100 tokens.

    Layers: 0 SWA-only (hash MoE), 1 CSA m=4 (hash MoE), 2 HCA m=8 (learned MoE), 3 CSA (learned MoE), MTP SWA.
    head_dim 80 = 64 nope + 16 rope (FP8 blocks of 64 fit); 16 indexer heads keep zero-score ties rare."""
    base = dict(
        vocab_size=512, dim=64, n_layers=4, n_heads=4, head_dim=80, rope_head_dim=16, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, window_size=8, compress_ratios=[0, 4, 8, 4, 0], index_n_heads=16,
        index_head_dim=32, index_topk=4, moe_inter_dim=32, n_routed_experts=8, n_shared_experts=1,
        n_activated_experts=3, score_func="sqrtsoftplus", route_scale=1.5, n_hash_layers=2, swiglu_limit=1.0,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, rope_theta=10000.0,
        compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0,
        max_position_embeddings=4096, n_mtp_layers=1,
    )
    base.update(overrides)
    return ModelConfig(**base).validate()


def make_hf_model(cfg: ModelConfig, seed: int = 0):
    """A float32 transformers DeepseekV4ForCausalLM with every parameter / routing buffer randomised.

    HF's own init leaves sinks, hc bases, position biases, router biases at 0 and tid2eid all zeros (every hash
    row picks expert 0 k times, which HF would count k times); we randomise them and give each tid2eid row
    DISTINCT experts."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_cfg = DeepseekV4Config.from_dict(cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if re.search(r"(norm|layernorm)\.weight$", name):
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif leaf in ("scale", "hc_scale"):
                v = 0.5 + torch.rand(p.shape, generator=g)
            elif leaf in ("base", "hc_base", "position_bias"):
                v = 0.3 * torch.randn(p.shape, generator=g)
            elif leaf == "sinks":
                v = torch.randn(p.shape, generator=g)
            elif name.endswith("embed_tokens.weight"):
                v = torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            p.copy_(v)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):
                V, k = b.shape
                b.copy_(torch.rand(V, cfg.n_routed_experts, generator=g).argsort(dim=-1)[:, :k])
    return model


_LAYER_RULES = [
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"), ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"), ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"), ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"), ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    ("mlp.experts.down_proj", "ffn.experts.w2"),
]
_TOP_RULES = {
    "model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def hf_to_official_state_dict(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers in-memory DeepseekV4ForCausalLM names -> official names with stacked experts."""
    out: dict[str, torch.Tensor] = {}
    rules = dict(_LAYER_RULES)
    for k, v in hf_sd.items():
        if "rotary_emb" in k:
            continue
        if k in _TOP_RULES:
            out[_TOP_RULES[k]] = v
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", k)
        if m is None:
            raise KeyError(f"unmapped HF key {k}")
        prefix, rest = f"layers.{m.group(1)}.", m.group(2)
        if rest == "mlp.experts.gate_up_proj":
            inter = v.shape[1] // 2
            out[prefix + "ffn.experts.w1"] = v[:, :inter]
            out[prefix + "ffn.experts.w3"] = v[:, inter:]
        elif rest in rules:
            out[prefix + rules[rest]] = v
        else:
            raise KeyError(f"unmapped HF key {k}")
    return out


def build_pair(cfg: ModelConfig, *, max_batch_size: int = 1, max_seq_len: int = 256, seed: int = 0,
               simulate_quant: bool = False, prefill_attn_rows: int | None = None):
    """(hf_model, our Transformer) in float32 on CPU with identical weights (MTP weights random)."""
    from dsv4_model.model.transformer import Transformer
    from dsv4_model.quant.random_model import init_random_weights

    hf = make_hf_model(cfg, seed)
    ours = Transformer(cfg, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=torch.float32,
                       device="cpu", simulate_quant=simulate_quant, prefill_attn_rows=prefill_attn_rows)
    init_random_weights(ours, seed + 1)
    sd = hf_to_official_state_dict(hf.state_dict())
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith("mtp.") for k in missing), [k for k in missing if not k.startswith("mtp.")]
    return hf, ours


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=ids, use_cache=True).logits.float()
