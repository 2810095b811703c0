"""The DSpark speculative module's tensors in a checkpoint (docs/dspark.md, "Layout").

S stages `mtp.0` .. `mtp.{S-1}`, each a V4 block with a sliding-window-only attention and a biased (not hashed)
router, i.e. the names and shapes of the model's own `Block` at a window-only layer past the main ones; stage 0
adds `main_proj` (FP8, [dim, len(target_layer_ids) * dim]) and `main_norm`, the last stage `norm`, `hc_head_*`,
the Markov head and the confidence head. The loader checks them against what the config implies and loads them
into dsv4_model.model.dspark.DSpark (or skips them: load_model(load_dspark=False)).
"""

from __future__ import annotations

import re

import torch

DSPARK_PREFIX = "mtp."
_STAGE_RE = re.compile(r"^mtp\.(\d+)\.")


def dspark_extra_shapes(cfg, n_stages: int) -> dict[str, tuple[int, ...]]:
    """{official name: shape} of the tensors a DSpark module has beyond its stages' V4 blocks."""
    sp, d, hc = cfg.dspark, cfg.dim, cfg.hc_mult
    last = f"mtp.{n_stages - 1}."
    return {
        "mtp.0.main_proj.weight": (d, len(sp.target_layer_ids) * d),  # the target layers' hidden states, concatenated
        "mtp.0.main_norm.weight": (d,),
        last + "norm.weight": (d,),
        last + "hc_head_fn": (hc, hc * d),
        last + "hc_head_base": (hc,),
        last + "hc_head_scale": (1,),
        last + "markov_head.markov_w1.weight": (cfg.vocab_size, sp.markov_rank),  # embedding of the previous token
        last + "markov_head.markov_w2.weight": (cfg.vocab_size, sp.markov_rank),  # rank -> vocab logit bias
        last + "confidence_head.proj.weight": (1, d + sp.markov_rank),  # [hidden, markov embedding] -> 1, no bias
    }


def stage_ratios(cfg, n_stages: int) -> tuple[int, ...]:
    return cfg.dspark.stage_ratios or (0,) * n_stages  # window-only where the config does not say


def stage_count(cfg, official_names) -> int:
    """The config's stage count, else (an HF config with `layer_types` only) the stages the checkpoint holds."""
    if cfg.dspark.n_stages:
        return cfg.dspark.n_stages
    found = {int(m.group(1)) for n in official_names if (m := _STAGE_RE.match(n))}
    return max(found) + 1 if found else 0


def dspark_expected(cfg, n_stages: int, dtype: torch.dtype,
                    stored_act_quant: str | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{state-dict-style name (routed experts stacked): (shape, dtype)} of the whole DSpark module: the state dict
    of dsv4's own `DSpark` (built on the meta device), whose stages are the model's `Block`, so they are checked
    like the main layers and load into it by the same plan. stored_act_quant: a converted dsv4 checkpoint's (its
    DSpark saved with the NVFP4 buffers, as the main model's)."""
    from dsv4_model.model.dspark import DSpark
    from dsv4_model.quant.quantize_model import convert_structure_

    with torch.device("meta"):
        module = DSpark(cfg, n_stages, dtype=dtype, device="meta")
    if stored_act_quant is not None:
        convert_structure_(module, stored_act_quant)
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
