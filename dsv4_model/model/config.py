"""DeepSeek-V4 model configuration (official `inference/config.json` field names).

`ModelConfig.from_dict` accepts the three config flavours a checkpoint may ship (docs/checkpoints.md "config.json"):
  * the official inference names (`dim`, `n_layers`, `compress_ratios`, `n_hash_layers`, ...),
  * the released top-level HF `config.json` (`hidden_size`, `compress_ratios`, `num_hash_layers`, `rope_scaling`),
  * transformers >= 5.23 `DeepseekV4Config` output (`layer_types`, `mlp_layer_types`, `compress_rates`,
    `rope_parameters` with nested `main` / `compress`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

from dsv4_model.model.dspark_config import DSparkConfig, dspark_from_dict
from dsv4_model.model.v41 import v41_refusal

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
# a config's `model_type` when it gives one (V4.1's is refused apart, in one line: model/v41.py)
V4_MODEL_TYPES = ("deepseek_v4",)

# transformers' layer-type labels; the compress ratio of each label comes from `compress_rates`.
HF_SWA, HF_CSA, HF_HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# The fields a checkpoint's config must give: they shape the model or change what it computes, so a default could
# only load the wrong model (or fail with a wall of shape mismatches). Every other field may be omitted and takes
# the DeepSeek-V4 value of its dataclass default (docs/checkpoints.md lists them). Per field, the keys that may
# carry it in an official / HF / transformers config (dotted: nested).
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "dim": ("dim", "hidden_size"),
    "n_layers": ("n_layers", "num_hidden_layers"),
    "n_heads": ("n_heads", "num_attention_heads"),
    "head_dim": ("head_dim",),
    "rope_head_dim": ("rope_head_dim", "qk_rope_head_dim", "partial_rotary_factor",
                      "rope_parameters.main.partial_rotary_factor"),
    "q_lora_rank": ("q_lora_rank",),
    "o_groups": ("o_groups",),
    "o_lora_rank": ("o_lora_rank",),
    "window_size": ("window_size", "sliding_window"),
    "compress_ratios": ("compress_ratios", "layer_types"),
    "moe_inter_dim": ("moe_inter_dim", "moe_intermediate_size"),
    "n_routed_experts": ("n_routed_experts", "num_local_experts"),
    "n_activated_experts": ("n_activated_experts", "num_experts_per_tok"),
    "n_hash_layers": ("n_hash_layers", "num_hash_layers", "mlp_layer_types"),
    "score_func": ("score_func", "scoring_func"),
    "route_scale": ("route_scale", "routed_scaling_factor"),
    "swiglu_limit": ("swiglu_limit",),
    "hc_mult": ("hc_mult",),
    "rope_theta": ("rope_theta", "rope_parameters.main.rope_theta"),
    "compress_rope_theta": ("compress_rope_theta", "rope_parameters.compress.rope_theta"),
}
# ... and, when a layer has an indexer (compress ratio 4), its shape and top-k
REQUIRED_INDEXER_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


def _has_key(d: dict[str, Any], dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(d, dict) or d.get(part) is None:
            return False
        d = d[part]
    return True


def missing_required_fields(d: dict[str, Any]) -> list[str]:
    """The required fields (REQUIRED_FIELDS names) that config dict `d` gives under none of their keys."""
    missing = [name for name, keys in REQUIRED_FIELDS.items() if not any(_has_key(d, k) for k in keys)]
    if "compress_ratios" not in missing:
        ratios = d.get("compress_ratios")
        rates = d.get("compress_rates")
        rates = rates if isinstance(rates, dict) else {}
        types = d.get("layer_types")
        csa = (4 in ratios if isinstance(ratios, list) else
               isinstance(types, list) and HF_CSA in types and rates.get(HF_CSA, 4) == 4)
        if csa:
            missing += [name for name in REQUIRED_INDEXER_FIELDS if d.get(name) is None]
    return missing


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # one entry per backbone layer plus one per MTP layer; 0 = sliding-window only
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [4, 128] * 20 + [4] + [0])
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    moe_inter_dim: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    n_hash_layers: int = 3
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536  # 0 disables YaRN on compressed layers
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    n_mtp_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    # every EOS id where config.json gives a list (HF allows one; the first is eos_token_id); empty: eos_token_id only
    eos_token_ids: tuple[int, ...] = ()
    # the DSpark speculative module a 0731-style checkpoint carries under `mtp.*` (not built: docs/dspark.md)
    dspark: DSparkConfig | None = None
    # Informational (checkpoint storage formats); the pure-PyTorch model does not read them.
    expert_dtype: str | None = None
    quantization_config: dict | None = None

    # ------------------------------------------------------------------ presets
    @classmethod
    def v4_flash(cls) -> "ModelConfig":
        return cls()

    @classmethod
    def v4_pro(cls) -> "ModelConfig":
        return cls(
            dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024,
            moe_inter_dim=3072, n_routed_experts=384, route_scale=2.5,
            compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0],
        )

    def sliced(self, n_layers: int | None = None, n_routed_experts: int | None = None,
               n_mtp_layers: int | None = None) -> "ModelConfig":
        """A validated copy with fewer layers (the first ones' compress ratios and hash routing), another expert
        count or MTP depth (MTP blocks are sliding-window only): a preset cut to what a benchmark or a random
        checkpoint needs. A DSpark config is dropped (its target layers name the full depth)."""
        layers = self.n_layers if n_layers is None else n_layers
        mtp = self.n_mtp_layers if n_mtp_layers is None else n_mtp_layers
        mtp_ratios = list(self.compress_ratios[self.n_layers:]) if n_mtp_layers is None else [0] * mtp
        return dataclasses.replace(
            self, n_layers=layers, n_mtp_layers=mtp, n_hash_layers=min(self.n_hash_layers, layers), dspark=None,
            compress_ratios=list(self.compress_ratios[:layers]) + mtp_ratios,
            n_routed_experts=self.n_routed_experts if n_routed_experts is None else n_routed_experts).validate()

    # ------------------------------------------------------------------ derived
    @property
    def n_total_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    def layer_ratio(self, layer_id: int) -> int:
        return int(self.compress_ratios[layer_id])

    # ------------------------------------------------------------------ validation
    def validate(self) -> "ModelConfig":
        def bad(name: str, why: str):
            raise ValueError(f"ModelConfig.{name}: {why} (got {getattr(self, name)!r})")

        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank",
                     "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
                     "moe_inter_dim", "n_routed_experts", "n_activated_experts", "hc_mult", "hc_sinkhorn_iters",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(name, "must be a positive int")
        for name in ("n_hash_layers", "n_mtp_layers", "n_shared_experts", "original_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, "must be a non-negative int")
        if self.rope_head_dim % 2:
            bad("rope_head_dim", "must be even (interleaved RoPE pairs)")
        if self.rope_head_dim >= self.head_dim:
            bad("rope_head_dim", f"must be smaller than head_dim={self.head_dim}")
        if self.rope_head_dim > self.index_head_dim:
            bad("index_head_dim", f"must be >= rope_head_dim={self.rope_head_dim}")
        if self.n_heads % self.o_groups:
            bad("o_groups", f"must divide n_heads={self.n_heads}")
        if self.n_activated_experts > self.n_routed_experts:
            bad("n_activated_experts", f"must be <= n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts != 1:
            bad("n_shared_experts", "the official model has exactly one shared expert")
        if self.n_hash_layers > self.n_layers:
            bad("n_hash_layers", f"must be <= n_layers={self.n_layers}")
        if self.score_func not in SCORE_FUNCS:
            bad("score_func", f"must be one of {SCORE_FUNCS}")
        if not isinstance(self.compress_ratios, (list, tuple)) or len(self.compress_ratios) != self.n_total_layers:
            bad("compress_ratios", f"needs n_layers + n_mtp_layers = {self.n_total_layers} entries")
        for r in self.compress_ratios:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                bad("compress_ratios", "entries must be non-negative ints (0 = sliding window only)")
            if r > self.window_size:
                # tokens of a not-yet-pooled window are only visible through the sliding window
                bad("compress_ratios", f"ratios must be <= window_size={self.window_size}")
        for name in ("hc_eps", "norm_eps", "rope_theta", "compress_rope_theta", "route_scale"):
            if not _is_real(getattr(self, name)) or not getattr(self, name) > 0:
                bad(name, "must be a finite number > 0")
        for name in ("rope_factor", "beta_fast", "beta_slow", "swiglu_limit"):
            if not _is_real(getattr(self, name)):
                bad(name, "must be a finite number")
        if self.original_seq_len > 0 and not self.rope_factor > 0:
            bad("rope_factor", "must be > 0 when YaRN is enabled (original_seq_len > 0)")
        if self.swiglu_limit < 0:
            bad("swiglu_limit", "must be >= 0 (0 disables the clamp)")
        if not _is_int(self.bos_token_id) or not 0 <= self.bos_token_id < self.vocab_size:
            bad("bos_token_id", f"must be a token id in [0, vocab_size={self.vocab_size})")
        # (an eos past the vocabulary is allowed here: a random test model's way to never stop; see
        # check_eos_in_vocab)
        if not _is_int(self.eos_token_id) or self.eos_token_id < 0:
            bad("eos_token_id", "must be a token id (an int >= 0)")
        ids = self.eos_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            bad("eos_token_ids", "must be a list of token ids (ints >= 0)")
        if ids and ids[0] != self.eos_token_id:
            bad("eos_token_ids", f"must start with eos_token_id={self.eos_token_id}")
        if self.dspark is not None:
            if not isinstance(self.dspark, DSparkConfig):
                bad("dspark", "must be a DSparkConfig or None")
            if self.n_mtp_layers:
                bad("n_mtp_layers", "must be 0 with a DSpark config (its checkpoint's mtp.* tensors are DSpark "
                    "stages, not an MTP block)")
            self.dspark.validate(self.n_layers, self.vocab_size)
        return self

    def check_eos_in_vocab(self) -> "ModelConfig":
        """Every EOS id lies in [0, vocab_size): an id the model can emit. Not part of validate(), where a random test
        model may park eos past its vocabulary so that no row stops; the loader holds a checkpoint that ships its
        tokenizer (a real model) to it."""
        for i in (self.eos_token_id, *self.eos_token_ids):
            if not 0 <= i < self.vocab_size:  # (named as config.json gives it: one id, or the list)
                got = list(self.eos_token_ids) if self.eos_token_ids else self.eos_token_id
                raise ValueError(f"eos_token_id: must be a token id in [0, vocab_size={self.vocab_size}) "
                                 f"(got {got!r})")
        return self

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Official field names; a DSpark config as the release writes it (flat `dspark_*` keys, the stages'
        compress ratios after the main layers')."""
        d = dataclasses.asdict(self)
        del d["dspark"]
        if self.eos_token_ids:
            d["eos_token_ids"] = list(self.eos_token_ids)
        else:
            del d["eos_token_ids"]
        d["compress_ratios"] = list(d["compress_ratios"])
        if self.dspark is not None:
            d.update(self.dspark.config_keys())
            d["compress_ratios"] += list(self.dspark.stage_ratios)
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, require: bool = True) -> "ModelConfig":
        """require: every REQUIRED_FIELDS entry must be present (a checkpoint's config); False fills any missing
        field with its default (configs written by code, tests)."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        refusal = v41_refusal(d)  # before the field checks: V4.1 nests its fields in text_config
        if refusal:
            raise ValueError(refusal)
        model_type = d.get("model_type")
        if model_type is not None and model_type not in V4_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a DeepSeek-V4 model (dsv4 runs model_type "
                             f"{' / '.join(map(repr, V4_MODEL_TYPES))} checkpoints)")
        _check_rope_objects(d)
        missing = missing_required_fields(d) if require else []
        if missing:
            keys = [f"{m!r}" + (f" (or {' / '.join(map(repr, REQUIRED_FIELDS[m][1:]))})"
                                if len(REQUIRED_FIELDS.get(m, ())) > 1 else "") for m in missing]
            raise ValueError(f"required field{'s' * (len(missing) > 1)} missing: {', '.join(keys)} (a checkpoint's "
                             "config must give every field that shapes the model; docs/checkpoints.md lists the "
                             "ones that may be omitted)")
        is_hf = d.get("model_type") == "deepseek_v4" or "hidden_size" in d or "num_hidden_layers" in d
        cfg = cls(**(_from_hf(d) if is_hf else _from_official(d)))
        return cfg.validate()

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-5.23 `DeepseekV4Config` dict (config.json layout, includes `model_type`)."""
        ratios = [int(r) for r in self.compress_ratios[: self.n_layers]]
        hca = sorted({r for r in ratios if r not in (0, 4)})
        if len(hca) > 1:
            raise ValueError(f"ModelConfig.compress_ratios: transformers supports one HCA ratio, got {hca}")
        hca_rate = hca[0] if hca else 128
        layer_types = [HF_SWA if r == 0 else HF_CSA if r == 4 else HF_HCA for r in ratios]
        compress = {"rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": self.rope_head_dim / self.head_dim}
        if self.original_seq_len > 0:
            compress.update(rope_type="yarn", factor=self.rope_factor,
                            original_max_position_embeddings=self.original_seq_len,
                            beta_fast=self.beta_fast, beta_slow=self.beta_slow, attention_factor=1.0)
        else:
            compress.update(rope_type="default")
        return {
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "moe_intermediate_size": self.moe_inter_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.rope_head_dim / self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "num_experts_per_tok": self.n_activated_experts,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "scoring_func": self.score_func,
            "norm_topk_prob": True,
            "routed_scaling_factor": self.route_scale,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                         "partial_rotary_factor": self.rope_head_dim / self.head_dim},
                "compress": compress,
            },
            "layer_types": layer_types,
            "compress_rates": {HF_CSA: 4, HF_HCA: hca_rate},
            "mlp_layer_types": ["hash_moe" if i < self.n_hash_layers else "moe" for i in range(self.n_layers)],
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "swiglu_limit": self.swiglu_limit,
            "sliding_window": self.window_size,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "rms_norm_eps": self.norm_eps,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if self.eos_token_ids else self.eos_token_id,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "attention_bias": False,
            # DSpark: the release's keys; the stage count only `compress_ratios` can carry (layer_types has one
            # entry per main layer)
            **({} if self.dspark is None else {
                **self.dspark.config_keys(), "compress_ratios": ratios + list(self.dspark.stage_ratios)}),
        }


_OFFICIAL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} - {"dspark"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    """A finite number (an int or a float; not a bool, not a string, not inf / nan)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


# Config values are type-checked where they are read, so that a bad one is one ValueError naming its key (as the
# config gives it) and value, not a traceback later, a message without the key, or a silent int() truncation
# (5.9 -> 5, "5" -> 5). Integers must be JSON integers (4.0 is refused, like "4"); reals may be either.
def _int_value(key: str, v):
    if not _is_int(v):
        raise ValueError(f"{key}: must be an integer, got {v!r}")
    return v


def _real_value(key: str, v):
    if not _is_real(v):
        raise ValueError(f"{key}: must be a finite number, got {v!r}")
    return v


def _int_list(key: str, v) -> list[int]:
    if not isinstance(v, (list, tuple)) or not all(_is_int(i) for i in v):
        raise ValueError(f"{key}: must be a list of integers, got {v!r}")
    return list(v)


def _str_list(key: str, v) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(i, str) for i in v):
        raise ValueError(f"{key}: must be a list of strings, got {v!r}")
    return list(v)


def _given(d: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """(key, value) of the first of `keys` (aliases of one field) that `d` gives (not null); None if none does. Two
    aliases given with different values are a ValueError naming both: which one a reader takes is not the
    config's author's to guess."""
    given = [(k, d[k]) for k in keys if d.get(k) is not None]
    for k, v in given[1:]:
        if v != given[0][1]:
            raise ValueError(f"{given[0][0]} and {k}: two names of one field with different values "
                             f"({given[0][1]!r} and {v!r}); give one")
    return given[0] if given else None


def _int_field(d: dict[str, Any], *keys: str, default=None):
    """The first of `keys` that `d` gives (not null), checked to be an integer; else `default`."""
    kv = _given(d, keys)
    return default if kv is None else _int_value(*kv)


def _real_field(d: dict[str, Any], *keys: str, default=None):
    """The first of `keys` that `d` gives (not null), checked to be a finite number; else `default`."""
    kv = _given(d, keys)
    return default if kv is None else _real_value(*kv)


# ModelConfig fields (official names) by the type their config value must have
_INT_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups",
               "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk", "moe_inter_dim",
               "n_routed_experts", "n_shared_experts", "n_activated_experts", "n_hash_layers", "hc_mult",
               "hc_sinkhorn_iters", "original_seq_len", "max_position_embeddings", "n_mtp_layers", "bos_token_id")
_REAL_FIELDS = ("route_scale", "swiglu_limit", "hc_eps", "norm_eps", "rope_theta", "compress_rope_theta",
                "rope_factor", "beta_fast", "beta_slow")


def _split_eos(out: dict[str, Any]) -> None:
    """HF's list form of eos_token_id -> eos_token_id (the first) + eos_token_ids (all, when more than one)."""
    eos = out.get("eos_token_id")
    if isinstance(eos, list):
        if not eos:
            raise ValueError("eos_token_id: an empty list (give a token id or a list of them)")
        if not all(_is_int(i) and i >= 0 for i in eos):
            raise ValueError(f"eos_token_id: must be a token id or a list of them (ints >= 0), got {eos!r}")
        out["eos_token_id"] = eos[0]
        out["eos_token_ids"] = tuple(eos) if len(eos) > 1 else ()
    elif "eos_token_ids" in out:
        if not isinstance(out["eos_token_ids"], list):
            raise ValueError(f"eos_token_ids: must be a list of token ids, got {out['eos_token_ids']!r}")
        out["eos_token_ids"] = tuple(out["eos_token_ids"])


# rope_parameters / rope_scaling entries the config is read from, and the type each must have
_ROPE_NUMBERS = ("rope_theta", "partial_rotary_factor", "factor", "beta_fast", "beta_slow")
_ROPE_INTS = ("original_max_position_embeddings",)
_ROPE_STRINGS = ("rope_type", "type")


def _check_rope_objects(d: dict[str, Any]) -> None:
    """rope_parameters (and its nested main / compress) and rope_scaling, where given, are objects whose read fields
    have their types: a ValueError naming the key, not an AttributeError deep in _from_hf."""
    def check(v, where: str) -> None:
        if not isinstance(v, dict):
            raise ValueError(f"{where}: must be an object (e.g. {{\"rope_type\": \"yarn\", \"factor\": 16, ...}}), "
                             f"got {v!r}")
        for k in _ROPE_NUMBERS:
            if v.get(k) is not None:
                _real_value(f"{where}.{k}", v[k])
        for k in _ROPE_INTS:
            if v.get(k) is not None:
                _int_value(f"{where}.{k}", v[k])
        for k in _ROPE_STRINGS:
            if v.get(k) is not None and not isinstance(v[k], str):
                raise ValueError(f"{where}.{k}: must be a string, got {v[k]!r}")

    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None:
            check(d[key], key)
    rp = d.get("rope_parameters")
    for part in ("main", "compress"):
        if isinstance(rp, dict) and rp.get(part) is not None:
            check(rp[part], f"rope_parameters.{part}")


def _from_official(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in d.items() if k in _OFFICIAL_FIELDS}
    for k in _INT_FIELDS:
        if k in out:
            _int_value(k, out[k])
    for k in _REAL_FIELDS:
        if k in out:
            _real_value(k, out[k])
    _split_eos(out)
    n_layers = out.get("n_layers", ModelConfig.n_layers)
    ratios = _int_list("compress_ratios", out["compress_ratios"]) if "compress_ratios" in out else None
    _split_ratios(d, out, ratios, n_layers, out.get("n_mtp_layers", ModelConfig.n_mtp_layers))
    return out


def _split_ratios(d: dict[str, Any], out: dict[str, Any], ratios: list[int] | None, n_layers: int,
                  n_mtp: int) -> None:
    """out's compress_ratios / n_mtp_layers / dspark from the config's full ratio list: a DSpark config's main
    model is the first n_layers entries and has no MTP block (the rest are the DSpark stages, whatever the MTP
    count keys say); otherwise the MTP entries are padded or cut to n_mtp."""
    dspark = dspark_from_dict(d, ratios, n_layers)
    if dspark is not None:
        out.update(dspark=dspark, n_mtp_layers=0)
        if ratios is not None:
            out["compress_ratios"] = ratios[:n_layers]
    elif ratios is not None:
        out["compress_ratios"] = _pad_mtp(ratios, n_layers, n_mtp)


def _pad_mtp(ratios: list[int], n_layers: int, n_mtp: int) -> list[int]:
    # MTP blocks are sliding-window only (official config: trailing 0 per MTP layer).
    if len(ratios) == n_layers:
        return ratios + [0] * n_mtp
    if len(ratios) > n_layers + n_mtp:
        return ratios[: n_layers + n_mtp]
    return ratios


def _first(d: dict[str, Any], *keys, default=None):
    kv = _given(d, keys)
    return default if kv is None else kv[1]


def _from_hf(d: dict[str, Any]) -> dict[str, Any]:
    base = ModelConfig()
    n_layers = _int_field(d, "num_hidden_layers", "n_layers", default=base.n_layers)
    n_mtp = _int_field(d, "num_nextn_predict_layers", "n_mtp_layers", default=base.n_mtp_layers)
    head_dim = _int_field(d, "head_dim", default=base.head_dim)
    out: dict[str, Any] = {
        "vocab_size": _int_field(d, "vocab_size", default=base.vocab_size),
        "dim": _int_field(d, "hidden_size", "dim", default=base.dim),
        "n_layers": n_layers,
        "n_heads": _int_field(d, "num_attention_heads", "n_heads", default=base.n_heads),
        "head_dim": head_dim,
        "q_lora_rank": _int_field(d, "q_lora_rank", default=base.q_lora_rank),
        "o_groups": _int_field(d, "o_groups", default=base.o_groups),
        "o_lora_rank": _int_field(d, "o_lora_rank", default=base.o_lora_rank),
        "window_size": _int_field(d, "sliding_window", "window_size", default=base.window_size),
        "index_n_heads": _int_field(d, "index_n_heads", default=base.index_n_heads),
        "index_head_dim": _int_field(d, "index_head_dim", default=base.index_head_dim),
        "index_topk": _int_field(d, "index_topk", default=base.index_topk),
        "moe_inter_dim": _int_field(d, "moe_intermediate_size", "moe_inter_dim", default=base.moe_inter_dim),
        "n_routed_experts": _int_field(d, "n_routed_experts", "num_local_experts", default=base.n_routed_experts),
        "n_shared_experts": _int_field(d, "n_shared_experts", default=base.n_shared_experts),
        "n_activated_experts": _int_field(d, "num_experts_per_tok", "n_activated_experts",
                                          default=base.n_activated_experts),
        "score_func": _first(d, "scoring_func", "score_func", default=base.score_func),
        "route_scale": _real_field(d, "routed_scaling_factor", "route_scale", default=base.route_scale),
        "swiglu_limit": _real_field(d, "swiglu_limit", default=base.swiglu_limit),
        "hc_mult": _int_field(d, "hc_mult", default=base.hc_mult),
        "hc_sinkhorn_iters": _int_field(d, "hc_sinkhorn_iters", default=base.hc_sinkhorn_iters),
        "hc_eps": _real_field(d, "hc_eps", default=base.hc_eps),
        "norm_eps": _real_field(d, "rms_norm_eps", "norm_eps", default=base.norm_eps),
        "rope_theta": _real_field(d, "rope_theta", default=base.rope_theta),
        "compress_rope_theta": _real_field(d, "compress_rope_theta", default=base.compress_rope_theta),
        "max_position_embeddings": _int_field(d, "max_position_embeddings", default=base.max_position_embeddings),
        "n_mtp_layers": n_mtp,
        "bos_token_id": _int_field(d, "bos_token_id", default=base.bos_token_id),
        "eos_token_id": _first(d, "eos_token_id", default=base.eos_token_id),
        "expert_dtype": _first(d, "expert_dtype"),
        "quantization_config": _first(d, "quantization_config"),
    }
    _split_eos(out)

    # rope dims: legacy qk_rope_head_dim > partial_rotary_factor (top-level or nested)
    rp = d.get("rope_parameters") or {}
    rope_dim = _int_field(d, "qk_rope_head_dim", "rope_head_dim")
    if rope_dim is None:
        prf_key = "partial_rotary_factor"
        prf = _real_field(d, prf_key)
        if prf is None and isinstance(rp.get("main"), dict):
            prf_key = "rope_parameters.main.partial_rotary_factor"
            prf = _real_field(rp["main"], "partial_rotary_factor")
        rope_dim = base.rope_head_dim
        if prf is not None:
            rope_dim = round(head_dim * prf)
            if abs(head_dim * prf - rope_dim) > 1e-6:  # not a whole number of dims: refused, not rounded
                raise ValueError(f"{prf_key}: times head_dim={head_dim} must give a whole number of rotary dims, "
                                 f"got {prf!r}")
    out["rope_head_dim"] = rope_dim

    # YaRN on compressed layers: nested rope_parameters["compress"] > flat rope_parameters > legacy rope_scaling
    yarn = None
    if isinstance(rp.get("compress"), dict):
        yarn = rp["compress"]
        if isinstance(rp.get("main"), dict) and "rope_theta" in rp["main"]:
            out["rope_theta"] = rp["main"]["rope_theta"]
        if "rope_theta" in yarn:
            out["compress_rope_theta"] = yarn["rope_theta"]
    elif rp:
        yarn = rp
    elif d.get("rope_scaling"):
        yarn = d["rope_scaling"]
    rtype = (yarn or {}).get("rope_type", (yarn or {}).get("type", "default"))
    if rtype == "yarn":
        # (types checked by _check_rope_objects; a null entry takes the default)
        out["rope_factor"] = _first(yarn, "factor", default=base.rope_factor)
        out["original_seq_len"] = _first(yarn, "original_max_position_embeddings", default=base.original_seq_len)
        out["beta_fast"] = yarn.get("beta_fast", base.beta_fast) or base.beta_fast
        out["beta_slow"] = yarn.get("beta_slow", base.beta_slow) or base.beta_slow
    else:
        out["original_seq_len"] = 0

    # attention schedule: legacy per-layer compress_ratios > layer_types + compress_rates
    if d.get("compress_ratios") is not None:
        ratios = _int_list("compress_ratios", d["compress_ratios"])
    elif d.get("layer_types") is not None:
        given = d.get("compress_rates")
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"compress_rates: must be an object (layer type -> compress rate), got {given!r}")
        rates = {t: _int_value(f"compress_rates.{t}", r) for t, r in (given or {HF_CSA: 4, HF_HCA: 128}).items()}
        for key, t in (("compress_rate_csa", HF_CSA), ("compress_rate_hca", HF_HCA)):
            if d.get(key) is not None:
                rates[t] = _int_value(key, d[key])
        rates[HF_SWA] = 0
        try:
            ratios = [rates[t] for t in _str_list("layer_types", d["layer_types"])[:n_layers]]
        except KeyError as e:
            raise ValueError(f"ModelConfig.compress_ratios: unknown layer type {e} in layer_types") from None
    else:
        # transformers' default schedule (2x HCA bootstrap, then CSA/HCA alternation)
        ratios = [128] * min(n_layers, 2) + [4 if i % 2 else 128 for i in range(max(n_layers - 2, 0))]
    # (layer_types has one entry per main layer: a DSpark config that gives only those leaves its stage count open)
    _split_ratios(d, out, ratios, n_layers, n_mtp)

    # hash layers: legacy num_hash_layers > leading "hash_moe" entries of mlp_layer_types
    if d.get("num_hash_layers") is not None or d.get("n_hash_layers") is not None:
        out["n_hash_layers"] = _int_field(d, "num_hash_layers", "n_hash_layers")
    elif d.get("mlp_layer_types") is not None:
        types = _str_list("mlp_layer_types", d["mlp_layer_types"])
        n_hash = 0
        while n_hash < len(types) and types[n_hash] == "hash_moe":
            n_hash += 1
        if "hash_moe" in types[n_hash:]:
            raise ValueError("ModelConfig.n_hash_layers: hash_moe layers must form a prefix of mlp_layer_types")
        out["n_hash_layers"] = n_hash
    else:
        out["n_hash_layers"] = min(3, n_layers)
    return out
