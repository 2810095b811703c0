"""scripts/soak.py on the CPU at a small scale: requests back to back that fill the caches and start over give
the same ids when repeated with the same seed, no non-finite logits and no recompiles (the H200 runs 100,000
steps: scripts/gpu_check.sh soak)."""
import importlib.util
import os

import torch

from dsv4_model.checkpoint.writer import write_tiny_checkpoint
from dsv4_model.runtime.engine import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", os.path.join(ROOT, "scripts", "soak.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_soak_repeats_identically(tmp_path):
    soak = _soak_module()
    write_tiny_checkpoint(tmp_path / "m", "dsv4", seed=0)
    engine = Engine.from_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32, max_batch_size=2,
                                    max_seq_len=80, progress=False)
    runs = [soak.soak(engine, steps=150, batch=2, seed=3, temperature=0.8) for _ in range(2)]
    assert runs[0]["requests"] >= 3  # the caches filled and restarted
    assert runs[0]["ids_sha256"] == runs[1]["ids_sha256"]
    assert all(r["nonfinite_logits"] == 0 and r["recompiles"] == 0 for r in runs)
    other = soak.soak(engine, steps=150, batch=2, seed=4, temperature=0.8)
    assert other["ids_sha256"] != runs[0]["ids_sha256"]  # the hash sees the ids
