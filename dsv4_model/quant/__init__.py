"""Quantized weights: NVFP4 modules and layouts, conversion from the checkpoint formats, random NVFP4 models.
Depends on dsv4_model.model."""
