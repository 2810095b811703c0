"""ModelConfig: the three config.json flavours, presets, HF round trip, validation messages."""

import dataclasses

import pytest

from dsv4_model.model.config import ModelConfig

from hf_utils import tiny_config

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]

# deepseek-ai/DeepSeek-V4-Flash inference/config.json (official names)
OFFICIAL_FLASH = {
    "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3, "n_heads": 64,
    "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64,
    "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "original_seq_len": 65536, "rope_theta": 10000,
    "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "dtype": "fp8", "scale_fmt": "ue8m0",
    "expert_dtype": "fp4", "compress_rope_theta": 160000, "compress_ratios": FLASH_RATIOS,
}

# the released top-level config.json (HF legacy names)
HF_LEGACY_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "bos_token_id": 0,
    "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64,
    "index_topk": 512, "max_position_embeddings": 1048576, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3, "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 129280,
    "compress_rope_theta": 160000, "compress_ratios": FLASH_RATIOS,
}

_INFO = ("expert_dtype", "quantization_config")


def _shape(cfg):
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _INFO}


def test_official_and_hf_legacy_configs_give_flash_preset():
    flash = _shape(ModelConfig.v4_flash())
    assert _shape(ModelConfig.from_dict(OFFICIAL_FLASH)) == flash
    assert _shape(ModelConfig.from_dict(HF_LEGACY_FLASH)) == flash
    assert ModelConfig.from_dict(HF_LEGACY_FLASH).expert_dtype == "fp4"


def test_transformers_config_roundtrip():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4Config(**{k: v for k, v in HF_LEGACY_FLASH.items()
                                          if k not in ("architectures", "model_type")})
    # transformers 5.23 rewrites the legacy names into layer_types / mlp_layer_types / rope_parameters
    d = hf.to_dict()
    assert "layer_types" in d and "mlp_layer_types" in d
    assert _shape(ModelConfig.from_dict(d)) == _shape(ModelConfig.v4_flash())
    for cfg in (ModelConfig.v4_flash(), ModelConfig.v4_pro(), tiny_config()):
        hd = cfg.to_hf_dict()
        back = transformers.DeepseekV4Config.from_dict(hd)
        assert _shape(ModelConfig.from_dict(back.to_dict())) == _shape(cfg)
        assert _shape(ModelConfig.from_dict(hd)) == _shape(cfg)


def test_pro_preset_schedule():
    pro = ModelConfig.v4_pro()
    r = pro.compress_ratios
    assert len(r) == 62 and r[:2] == [128, 128] and r[-1] == 0
    assert all(r[i] == 4 for i in range(2, 61, 2)) and all(r[i] == 128 for i in range(3, 60, 2))
    assert (pro.dim, pro.n_heads, pro.o_groups, pro.n_routed_experts, pro.index_topk) == (7168, 128, 16, 384, 1024)


def test_to_dict_from_dict_and_json(tmp_path):
    cfg = tiny_config()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    cfg.to_json(tmp_path / "config.json")
    assert ModelConfig.from_json(tmp_path) == cfg


def test_official_config_without_mtp_entry_gets_swa_mtp():
    d = dict(OFFICIAL_FLASH, compress_ratios=FLASH_RATIOS[:43])
    assert ModelConfig.from_dict(d).compress_ratios == FLASH_RATIOS


@pytest.mark.parametrize("field, kw", [
    ("o_groups", dict(n_heads=6, o_groups=4)),
    ("compress_ratios", dict(compress_ratios=[0, 4])),
    ("compress_ratios", dict(compress_ratios=[0, 4, 256, 4, 0])),
    ("score_func", dict(score_func="relu")),
    ("n_activated_experts", dict(n_activated_experts=9)),
    ("rope_head_dim", dict(rope_head_dim=15)),
    ("dim", dict(dim=0)),
    ("n_hash_layers", dict(n_hash_layers=5)),
])
def test_validate_names_the_bad_field(field, kw):
    with pytest.raises(ValueError, match=field):
        tiny_config(**kw)


@pytest.mark.parametrize("config, drop, named", [
    (OFFICIAL_FLASH, "window_size", "'window_size'"),
    (OFFICIAL_FLASH, "dim", "'dim'"),
    (OFFICIAL_FLASH, "index_topk", "'index_topk'"),  # CSA layers: the indexer's top-k has no safe default
    (OFFICIAL_FLASH, "compress_rope_theta", "'compress_rope_theta'"),
    (HF_LEGACY_FLASH, "sliding_window", "'window_size' (or 'sliding_window')"),
    (HF_LEGACY_FLASH, "hidden_size", "'dim' (or 'hidden_size')"),
    (HF_LEGACY_FLASH, "num_hash_layers", "'n_hash_layers'"),
])
def test_a_checkpoint_config_missing_a_required_field_is_refused_by_name(config, drop, named):
    d = {k: v for k, v in config.items() if k != drop}
    with pytest.raises(ValueError, match="required field missing: " + named.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict(d)
    assert ModelConfig.from_dict(d, require=False)  # code-written configs may still rely on defaults


def test_fields_with_documented_defaults_may_be_omitted():
    optional = ("hc_eps", "hc_sinkhorn_iters", "norm_eps", "beta_fast", "beta_slow", "n_shared_experts",
                "n_mtp_layers", "max_position_embeddings", "bos_token_id", "eos_token_id", "rope_factor",
                "original_seq_len")
    d = {k: v for k, v in OFFICIAL_FLASH.items() if k not in optional}
    assert _shape(ModelConfig.from_dict(d)) == _shape(ModelConfig.v4_flash())


def test_a_config_without_indexer_layers_needs_no_indexer_fields():
    d = {k: v for k, v in OFFICIAL_FLASH.items() if not k.startswith("index_")}
    d.update(compress_ratios=[0, 0] + [128] * 41 + [0])
    assert ModelConfig.from_dict(d).index_topk == ModelConfig.index_topk


@pytest.mark.parametrize("bad", [[1, 2], "config", 3])
def test_a_config_that_is_not_an_object_is_refused(bad):
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_dict(bad)


def test_sliced_keeps_the_first_layers_plan():
    flash = ModelConfig.v4_flash()
    c = flash.sliced(4, 32, n_mtp_layers=0)
    assert (c.n_layers, c.n_routed_experts, c.n_mtp_layers) == (4, 32, 0)
    assert c.compress_ratios == flash.compress_ratios[:4] and c.n_hash_layers == flash.n_hash_layers
    d = flash.sliced(2)
    assert d.n_hash_layers == 2 and d.compress_ratios == flash.compress_ratios[:2] + flash.compress_ratios[43:]
    assert flash.n_layers == 43  # a copy
    with pytest.raises(ValueError, match="n_activated_experts"):
        flash.sliced(2, 4)
