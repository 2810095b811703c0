"""A DSpark module kept apart from its main model's checkpoint (docs/dspark.md, "A drafter directory"): what
scripts/train_dspark.py writes for a model whose release has none (the built-in one), and a way to try another
drafter on a checkpoint that carries its own. The directory holds

    dspark_config.json   the release's four `dspark_*` keys + `n_stages` (the stages are window-only)
    dspark.safetensors   the module's float tensors under their dsv4 names `mtp.0..S-1.*` (routed experts
                         stacked, as `DSpark.state_dict()`; an index + shards also read)

`load_model(path, drafter=DIR)` builds the main model from `path` (without its own MTP block or DSpark module) and
the DSpark module from DIR, checked against the main model's config like a 0731 checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from dsv4_model.checkpoint.io import CheckpointError
from dsv4_model.model.dspark_config import DSPARK_KEYS, DSparkConfig

CONFIG_NAME = "dspark_config.json"
WEIGHTS_NAME = "dspark.safetensors"


def drafter_dir(path: str | os.PathLike) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"drafter {root}: not a directory (a DSpark drafter directory holds {CONFIG_NAME} "
                              f"and {WEIGHTS_NAME}: docs/dspark.md)")
    if not (root / CONFIG_NAME).is_file():
        raise CheckpointError(f"drafter {root}: no {CONFIG_NAME} (a DSpark drafter directory holds {CONFIG_NAME} and "
                              f"{WEIGHTS_NAME}: docs/dspark.md)")
    if not any(root.glob("*.safetensors")):
        raise CheckpointError(f"drafter {root}: no {WEIGHTS_NAME} (nor any *.safetensors file)")
    return root


def with_drafter(config, path: str | os.PathLike):
    """`config` (the main model's) with the DSpark module of drafter directory `path`: its `dspark` set, no MTP
    block, the main layers' compress ratios only. Raises CheckpointError naming the file and key at fault."""
    root = drafter_dir(path)
    cfg_path = root / CONFIG_NAME
    try:
        d = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_path}: must hold a JSON object")
    keys = [*DSPARK_KEYS, "n_stages"]
    missing = [k for k in keys if k not in d]
    if missing:
        raise CheckpointError(f"{cfg_path}: {missing[0]}: missing (a drafter config gives {', '.join(keys)})")
    n = d["n_stages"]
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise CheckpointError(f"{cfg_path}: n_stages: must be a positive int, got {n!r}")
    ids = d["dspark_target_layer_ids"]
    if not isinstance(ids, list):
        raise CheckpointError(f"{cfg_path}: dspark_target_layer_ids: must be a list of layer ids, got {ids!r}")
    try:
        sp = DSparkConfig(d["dspark_block_size"], d["dspark_markov_rank"], tuple(ids), d["dspark_noise_token_id"],
                          stage_ratios=(0,) * n).validate(config.n_layers, config.vocab_size)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    ratios = list(config.compress_ratios)[: config.n_layers]
    return dataclasses.replace(config, dspark=sp, n_mtp_layers=0, compress_ratios=ratios)
