"""torchrun worker of tests/test_torchrun.py: loads each given checkpoint with this rank's expert shard and saves
(rank 0) the logits of a ragged prefill and greedy decode steps, eager and (the first checkpoint) with the step compiled
whole."""
import sys

import torch
import torch.distributed as dist

from dsv4_model.model.parallel import ExpertShard
from dsv4_model.runtime import distributed
from dsv4_model.runtime.engine import Engine


def logits(engine: Engine, steps: int, compiled: bool) -> torch.Tensor:
    model = engine.model
    step = torch.compile(model.decode_step, fullgraph=True, dynamic=False, backend="aot_eager") if compiled \
        else model.decode_step
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([7, 3])
    out = [engine.prefill(ids, lengths=lengths)]
    tok, pos = out[0].argmax(-1), lengths.clone()
    for _ in range(steps):
        out.append(step(tok, pos))
        tok, pos = out[-1].argmax(-1), pos + 1
    return torch.stack(out)


def load(path, shard=None) -> Engine:
    return Engine.from_pretrained(path, device="cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=128,
                                  progress=False, expert_shard=shard)


def main(out: str, steps: int, paths: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    shard = ExpertShard.of_group()
    res = {}
    for p in paths:
        eng = load(p, shard)
        for compiled in (False, True) if p == paths[0] else (False,):  # the layouts load to one model: one trace
            torch._dynamo.reset()
            res[(p, compiled)] = logits(eng, steps, compiled)
    if shard.rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()
    distributed.exit_rank(0)  # torch 2.13's gloo ranks may abort at interpreter teardown


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
