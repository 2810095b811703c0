"""Prints docs/memory.md's table: GiB per GPU (dsv4_model.checkpoint.memory_plan) for V4-Flash / V4-Pro, NVFP4
W4A16, experts split over the GPUs (expert parallel, the rest replicated), at 4K / 128K / 1M tokens and batch 1 / 64;
then what the DSpark module of a V4-Flash-0731 checkpoint (docs/dspark.md) adds per GPU, NVFP4 and bf16 (batch 1).

    python scripts/memory_plan_table.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4_model.model.config import ModelConfig  # noqa: E402
from dsv4_model.checkpoint.memory_plan import GiB, memory_plan  # noqa: E402

H200_GIB = 139  # what one H200 offers torch

print("| model | context | batch | caches, GiB | GiB per GPU: 2 GPUs | 4 GPUs | 8 GPUs |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name in ("v4_flash", "v4_pro"):
    cfg = getattr(ModelConfig, name)().validate()
    for ctx, label in ((4096, "4K"), (131072, "128K"), (2**20, "1M")):
        for batch in (1, 64):
            cells, caches = [], None
            for gpus in (2, 4, 8):
                p = memory_plan(cfg, max_batch_size=batch, max_seq_len=ctx, ep=gpus)
                caches = p.caches
                total = p.total / GiB
                cells.append(f"{total:.0f}" + ("" if total <= H200_GIB else " (no)"))
            print(f"| {name} | {label} | {batch} | {caches / GiB:.1f} | " + " | ".join(cells) + " |")

# V4-Flash-0731: the main model (no MTP block) + 3 DSpark stages, counted as the loader holds them
flash = ModelConfig.v4_flash().to_dict()
flash.update({"compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0], "n_mtp_layers": 3, "dspark_block_size": 5,
              "dspark_markov_rank": 256, "dspark_target_layer_ids": [40, 41, 42], "dspark_noise_token_id": 128799})
cfg = ModelConfig.from_dict(flash).validate()
print()
print("| V4-Flash-0731 DSpark module | GiB per GPU: 1 GPU | 2 GPUs | 4 GPUs | 8 GPUs |")
print("|---|---:|---:|---:|---:|")
for quant, label in (("nvfp4", "NVFP4 (--quant nvfp4)"), ("none", "bf16 (--quant none)")):
    cells = [f"{memory_plan(cfg, quant=quant, ep=gpus, dspark_stages=3).dspark / GiB:.1f}" for gpus in (1, 2, 4, 8)]
    print(f"| {label} | " + " | ".join(cells) + " |")
