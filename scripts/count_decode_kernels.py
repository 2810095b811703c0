"""Kernels Inductor generates for one compiled decode step of a tiny CSA + HCA model, with the fused decode steps'
switches all off or all on (DSV4_FUSED_COMPRESSOR, _NORM_ROPE, _HC_POST, _HADAMARD, _KEY_STORE, _OUT_ROPE): a
CPU-side view of the glue the fused ops remove (the dsv4 ops themselves are not counted; on the GPU, Triton
fuses differently: bench/bench_layer.py counts the H200's kernels).

Run: python scripts/count_decode_kernels.py [--device cpu|cuda]
"""
import argparse
import os
import subprocess
import sys

SWITCHES = ("DSV4_FUSED_COMPRESSOR", "DSV4_FUSED_NORM_ROPE", "DSV4_FUSED_HC_POST", "DSV4_FUSED_HADAMARD",
            "DSV4_FUSED_KEY_STORE", "DSV4_FUSED_OUT_ROPE")


def count(device: str) -> int:
    import torch
    import torch._inductor.metrics as metrics

    from dsv4_model.checkpoint_writer import TINY_CONFIG
    from dsv4_model.config import ModelConfig
    from dsv4_model.model import Transformer

    cfg = ModelConfig(**{**TINY_CONFIG, "n_layers": 2, "compress_ratios": [4, 16], "n_mtp_layers": 0,
                         "index_head_dim": 64}).validate()
    m = Transformer(cfg, max_batch_size=1, max_seq_len=64, dtype=torch.float32, device=device).init_random_weights(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), device=device)
    m.prefill(ids)
    step = torch.compile(m.decode_step, fullgraph=True)
    metrics.reset()
    with torch.no_grad():
        step(ids[:, 0], torch.tensor([9], device=device))
    return metrics.generated_kernel_count


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", choices=("0", "1"))
    args = ap.parse_args()
    if args.child:  # one process per setting: the switches are read when the step is traced
        print(count(args.device))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for mode in ("0", "1"):
        env = {**os.environ, **{k: mode for k in SWITCHES}, "PYTHONPATH": root}
        out = subprocess.run([sys.executable, __file__, "--device", args.device, "--child", mode], env=env,
                             capture_output=True, text=True, check=True).stdout.split()[-1]
        print(f"fused decode steps {'on ' if mode == '1' else 'off'}: {out} Inductor kernels per decode step "
              f"(2 layers: CSA + HCA, {args.device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
