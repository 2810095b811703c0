"""Expert parallelism on the CPU (gloo, 2 processes): every rank holds half of each MoE layer's routed experts
(dsv4_model.model.parallel) and ends each layer with the single-process result: float experts to fp32 summation
order, NVFP4 experts bit for bit (their uncombined rows cross the ranks), through a ragged prefill and greedy
decode steps."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4_model.checkpoint.writer import TINY_CONFIG
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.parallel import ExpertShard
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

WORLD = 2
STEPS = 6


def _model(quant: str) -> Transformer:
    cfg = ModelConfig(**{**TINY_CONFIG, "n_layers": 3, "compress_ratios": [0, 4, 16], "n_mtp_layers": 0,
                         "n_hash_layers": 1, "n_routed_experts": 8}).validate()
    model = Transformer(cfg, max_batch_size=2, max_seq_len=48, dtype=torch.float32, device="cpu")
    init_random_weights(model, 5)
    if quant == "nvfp4":
        from dsv4_model.quant.quantize_model import quantize_model_

        quantize_model_(model)
    return model


def _logits(model: Transformer, compiled: bool = False) -> torch.Tensor:
    """A ragged prefill, then greedy decode steps (compiled: the step traced whole, collectives included)."""
    step = torch.compile(model.decode_step, fullgraph=True, dynamic=False, backend="aot_eager") if compiled \
        else model.decode_step
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([9, 4])
    out = [model.prefill(ids, lengths)]
    tok, pos = out[0].argmax(-1), lengths.clone()
    for _ in range(STEPS):
        out.append(step(tok, pos))
        tok, pos = out[-1].argmax(-1), pos + 1
    return torch.stack(out)


def _rank(rank: int, init: str, out_dir: str, quant: str, compiled: bool) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: gloo over loopback
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        model = _model(quant).shard_experts_(ExpertShard.of_group())
        experts = [m.nvfp4.n_experts if quant == "nvfp4" else m.experts.n_experts
                   for m in model.modules() if type(m).__name__ == "MoE"]
        torch.save({"logits": _logits(model, compiled), "experts": experts}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # done: torch 2.13's gloo may abort at interpreter teardown (runtime/distributed.exit_rank)


@pytest.mark.parametrize("quant,compiled", [("none", False), ("nvfp4", False), ("nvfp4", True)])
def test_expert_parallel_matches_one_process(tmp_path, quant, compiled):
    ref = _logits(_model(quant))
    mp.spawn(_rank, args=(f"file://{tmp_path}/pg", str(tmp_path), quant, compiled), nprocs=WORLD)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["experts"] == [8 // WORLD] * 3  # each rank holds half of every layer's experts
        if quant == "nvfp4":
            assert torch.equal(got["logits"], ref), f"rank {rank}: {float((got['logits'] - ref).abs().max()):.3g}"
        else:
            torch.testing.assert_close(got["logits"], ref, atol=1e-5, rtol=1e-5)


def test_the_shard_checks_its_arguments():
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        ExpertShard(2, 2)
    with pytest.raises(ValueError, match="divisible by 3"):
        ExpertShard(0, 3).bounds(8)
    assert ExpertShard(1, 4).bounds(8) == (2, 2)
