"""Kernels Inductor generates for one compiled decode step of a tiny CSA + HCA model, with the fused decode steps
all off or all on (DecodeOptions: compressor, norm_rope, hc_post_pre, hadamard, key_store, out_rope): a CPU-side
view of the glue the fused ops remove (the dsv4 ops themselves are not counted; on the GPU, Triton fuses
differently: bench/bench_layer.py counts the H200's kernels).

Run: python scripts/count_decode_kernels.py [--device cpu|cuda]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FUSED = ("compressor", "norm_rope", "hc_post_pre", "hadamard", "key_store", "out_rope")


def count(device: str, on: bool) -> int:
    import torch
    import torch._inductor.metrics as metrics

    from dsv4_model.checkpoint.writer import TINY_CONFIG
    from dsv4_model.model.config import ModelConfig
    from dsv4_model.model.decode_options import DecodeOptions
    from dsv4_model.model.transformer import Transformer
    from dsv4_ops.inductor import register_inductor_fallbacks

    register_inductor_fallbacks()
    torch._dynamo.reset()
    cfg = ModelConfig(**{**TINY_CONFIG, "n_layers": 2, "compress_ratios": [4, 16], "n_mtp_layers": 0,
                         "index_head_dim": 64}).validate()
    m = Transformer(cfg, max_batch_size=1, max_seq_len=64, dtype=torch.float32, device=device).init_random_weights(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), device=device)
    m.prefill(ids)
    opts = DecodeOptions(**{name: on for name in FUSED})
    step = torch.compile(lambda t, p: m.decode_step(t, p, opts), fullgraph=True)
    metrics.reset()
    with torch.no_grad():
        step(ids[:, 0], torch.tensor([9], device=device))
    return metrics.generated_kernel_count


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for on in (False, True):
        print(f"fused decode steps {'on ' if on else 'off'}: {count(args.device, on)} Inductor kernels per decode "
              f"step (2 layers: CSA + HCA, {args.device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
