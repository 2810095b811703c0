"""Kernels Inductor generates for one compiled decode step of a tiny CSA + HCA model, as shipped and with the
debug overrides (DecodeOptions: mHC as tensor ops, the attention's tensor-op form): a CPU-side view of the glue
the fused ops remove (the dsv4 ops themselves are not counted; on the GPU, Triton fuses differently:
bench/bench_layer.py counts the H200's kernels).

Run: python scripts/count_decode_kernels.py [--device cpu|cuda]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OVERRIDES = ("", "hc_pre=0", "attention=torch", "hc_pre=0,attention=torch")


def count(device: str, overrides: str) -> int:
    import torch
    import torch._inductor.metrics as metrics

    from dsv4_model.checkpoint.writer import TINY_CONFIG
    from dsv4_model.model.config import ModelConfig
    from dsv4_model.model.decode_options import DecodeOptions
    from dsv4_model.model.transformer import Transformer
    from dsv4_model.quant.random_model import init_random_weights
    from dsv4_ops.inductor import register_inductor_fallbacks

    register_inductor_fallbacks()
    torch._dynamo.reset()
    cfg = ModelConfig(**{**TINY_CONFIG, "n_layers": 2, "compress_ratios": [4, 16], "n_mtp_layers": 0,
                         "index_head_dim": 64}).validate()
    m = init_random_weights(Transformer(cfg, max_batch_size=1, max_seq_len=64, dtype=torch.float32, device=device), 0)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), device=device)
    m.prefill(ids)
    opts = DecodeOptions.parse(overrides)
    step = torch.compile(lambda t, p: m.decode_step(t, p, opts), fullgraph=True)
    metrics.reset()
    with torch.no_grad():
        step(ids[:, 0], torch.tensor([9], device=device))
    return metrics.generated_kernel_count


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for overrides in OVERRIDES:
        print(f"{overrides or 'shipped':>26}: {count(args.device, overrides)} Inductor kernels per decode step "
              f"(2 layers: CSA + HCA, {args.device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
