"""The DSpark speculative module's config (DeepSeek-V4-Flash-0731, V4-Pro-0813; docs/dspark.md).

A DSpark checkpoint keeps the main model's config and adds four `dspark_*` keys; its `compress_ratios` runs past
the main layers with one entry per DSpark stage (0: the stages are sliding-window only), while the MTP-layer count
keys are not to be trusted (the HF config keeps `num_nextn_predict_layers: 1`, the inference config says
`n_mtp_layers: 3`). dsv4 builds the main model only and skips the stages' tensors (checkpoint/loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# config key -> DSparkConfig field
DSPARK_KEYS = {
    "dspark_block_size": "block_size",
    "dspark_markov_rank": "markov_rank",
    "dspark_target_layer_ids": "target_layer_ids",
    "dspark_noise_token_id": "noise_token_id",
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class DSparkConfig:
    block_size: int  # tokens drafted per step (anchor + noise placeholders)
    markov_rank: int  # rank of the Markov head's previous-token bias on the shared head's logits
    target_layer_ids: tuple[int, ...]  # main layers whose input hidden state (mean over hc copies) feeds stage 0
    noise_token_id: int  # placeholder token of the not-yet-drafted block positions
    # compress ratio per stage (the trailing compress_ratios entries); () = the config does not say how many
    # stages there are (an HF config with `layer_types` only): the loader counts them in the checkpoint
    stage_ratios: tuple[int, ...] = ()

    @property
    def n_stages(self) -> int | None:
        return len(self.stage_ratios) or None

    def validate(self, n_layers: int, vocab_size: int) -> "DSparkConfig":
        def bad(key: str, why: str, got):
            raise ValueError(f"{key}: {why} (DSpark config; got {got!r})")

        for key in ("dspark_block_size", "dspark_markov_rank"):
            v = getattr(self, DSPARK_KEYS[key])
            if not _is_int(v) or v <= 0:
                bad(key, "must be a positive int", v)
        ids = self.target_layer_ids
        if not isinstance(ids, tuple) or not ids or not all(_is_int(i) for i in ids):
            bad("dspark_target_layer_ids", "must be a non-empty list of layer ids", ids)
        if any(not 0 <= i < n_layers for i in ids) or len(set(ids)) != len(ids):
            bad("dspark_target_layer_ids", f"must be distinct main-layer ids in [0, n_layers={n_layers})", list(ids))
        if not _is_int(self.noise_token_id) or not 0 <= self.noise_token_id < vocab_size:
            bad("dspark_noise_token_id", f"must be a token id in [0, vocab_size={vocab_size})", self.noise_token_id)
        if any(r != 0 for r in self.stage_ratios):
            # the released stages are window-only; a compressed stage would need tensors nobody has described
            bad("compress_ratios", f"the entries past n_layers={n_layers} are the DSpark stages' and must be 0 "
                "(sliding window only)", list(self.stage_ratios))
        return self

    def config_keys(self) -> dict[str, Any]:
        """The release's flat config keys."""
        return {key: (list(v) if isinstance(v := getattr(self, f), tuple) else v) for key, f in DSPARK_KEYS.items()}


def dspark_from_dict(d: dict[str, Any], ratios: list[int] | None, n_layers: int) -> DSparkConfig | None:
    """The DSpark config of checkpoint config `d` (None when it has no `dspark_*` key); `ratios`: its full
    compress-ratio list (None if it gives none). Raises ValueError naming a missing or malformed key."""
    present = [k for k in DSPARK_KEYS if d.get(k) is not None]
    if not present:
        return None
    missing = [k for k in DSPARK_KEYS if k not in present]
    if missing:
        raise ValueError(f"{missing[0]}: missing (a DSpark config gives all of {', '.join(DSPARK_KEYS)}; this one "
                         f"gives {', '.join(present)})")
    ids = d["dspark_target_layer_ids"]
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"dspark_target_layer_ids: must be a list of layer ids (DSpark config; got {ids!r})")
    stages = tuple(ratios[n_layers:]) if ratios is not None else ()
    return DSparkConfig(block_size=d["dspark_block_size"], markov_rank=d["dspark_markov_rank"],
                        target_layer_ids=tuple(ids), noise_token_id=d["dspark_noise_token_id"], stage_ratios=stages)
