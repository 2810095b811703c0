"""Fakes for the NVFP4 quantization ops (filled in by the quantization work)."""
