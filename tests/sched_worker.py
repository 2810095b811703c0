"""torchrun worker of tests/test_torchrun.py: rank 0 runs a Scheduler over staggered requests (greedy and sampled,
more than rows, one cancelled, one scoring its prompt; then two sharing a prefix snapshot) while the other ranks
follow its broadcast plans; rank 0 saves each request's ids, finish reason, prompt log-probabilities and reused
tokens."""
import sys

import torch
import torch.distributed as dist

from dsv4_model.model.parallel import ExpertShard
from dsv4_model.runtime import distributed
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.sampling import SamplingParams
from dsv4_model.runtime.scheduler import Scheduler
from dsv4_model.runtime.step_plan import follow

PROMPTS = [[1, 5, 9, 13, 2, 7, 30, 31, 8], [1, 4], [1, 17, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 20], [1, 6, 6],
           [1, 2, 3, 4, 5, 6, 7]]
ROWS, CHUNK = 3, 5
SHARED = [1, 9, 8, 7, 6, 5, 4, 3, 2, 11, 12, 13]  # a prefix two later prompts share (snapshot at its end)


def params(i: int) -> SamplingParams:
    return SamplingParams(seed=50 + i) if i % 2 else SamplingParams(0.9, 8, 0.9, 50 + i)


def engine(path, shard=None) -> Engine:
    return Engine.from_pretrained(path, device="cpu", dtype=torch.float32, max_batch_size=ROWS, max_seq_len=128,
                                  progress=False, expert_shard=shard)


def run(eng: Engine, distributed: bool = False) -> list[tuple[list[int], str, list[float], int]]:
    """Rank 0's side: the requests, staggered; request 4 is cancelled after its 5th token; request 2 scores its
    prompt (prompt_logprobs: its chunks take the scored prefill on every rank); then two prompts starting with
    SHARED, the second continuing from a copy of the first's snapshot (copies and keeps travel in the plans)."""
    s = Scheduler(eng, max_prefill_tokens=CHUNK, distributed=distributed, snapshot_min_tokens=4)
    reqs = []
    for i, p in enumerate(PROMPTS):
        scored = 1 if i == 2 else None
        reqs.append(s.submit(Request(p, params(i), 24 + 2 * i, ignore_eos=True, prompt_logprobs=scored)))
        s.step()
    while not s.idle():
        if len(reqs[4].token_ids) >= 5:
            reqs[4].cancel()
        s.step()
    for i, tail in enumerate(([40, 41], [50, 51, 52])):
        reqs.append(s.submit(Request(SHARED + tail, params(i), 12, ignore_eos=True, snapshot_at=(len(SHARED),))))
        s.run_until_idle()
    s.close()
    return [(r.token_ids, r.finish_reason, [lp for lp, _ in r.prompt_token_logprobs], r.reused_tokens)
            for r in reqs]


def main(out: str, path: str, wire: str = "group") -> None:
    """wire "separate": the plans travel through a gloo group of their own, as they do over NCCL
    (step_plan.plan_group), rather than through the gloo group itself."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if wire == "separate":
        import dsv4_model.runtime.scheduler as sched_mod
        import dsv4_model.runtime.step_plan as plan_mod

        made = plan_mod.plan_group
        plan_mod.plan_group = sched_mod.plan_group = lambda group=None, separate=None: made(group, separate=True)
    shard = ExpertShard.of_group()
    eng = engine(path, shard)
    if shard.rank == 0:
        torch.save(run(eng, distributed=True), out)
    else:
        follow(eng)
    dist.destroy_process_group()
    distributed.exit_rank(0)  # torch 2.13's gloo ranks may abort at interpreter teardown


if __name__ == "__main__":
    main(*sys.argv[1:])
