"""The scheduler's host time per iteration (dsv4_model.runtime.scheduler), with a model stub whose step costs
(almost) nothing: what continuous batching adds to every decode step on the host. Goal (issue #48): <= 50 µs per
iteration at 64 live rows on the CPU machine.

The stub's decode step returns fixed logits [rows, 64] (no layers); the sampler op still runs, so the figure is
an upper bound on the scheduler's own share. Every row generates (no prefill in the timed window): steady state.
The same run times the stub's step alone (subtracted: the scheduler's own share) and the static generate() loop
on the same stub (its host work per step), the peer in the same run.

Run: python bench/bench_scheduler.py [--rows 1,8,64] [--steps 2000]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dsv4_ops  # noqa: E402,F401
from dsv4_model.runtime.generate import generate  # noqa: E402
from dsv4_model.runtime.requests import Request  # noqa: E402
from dsv4_model.runtime.scheduler import Scheduler  # noqa: E402
from dsv4_model.runtime.session import EngineSession, RunnerOptions  # noqa: E402

V = 64


class StubModel(torch.nn.Module):
    def __init__(self, rows: int, max_seq_len: int):
        super().__init__()
        self.max_batch_size, self.max_seq_len = rows, max_seq_len
        self.register_buffer("logits", torch.randn(rows, V))

    @property
    def device(self):
        return self.logits.device

    def decode_step(self, tokens, positions, options=None):
        return self.logits[: tokens.shape[0]]


class StubEngine(EngineSession):
    def __init__(self, rows: int, max_seq_len: int):
        self.model = StubModel(rows, max_seq_len)
        self.config = types.SimpleNamespace(vocab_size=V, bos_token_id=0, eos_token_id=V + 1)  # never sampled
        self.device, self.path = torch.device("cpu"), None
        self.max_batch_size, self.max_seq_len, self.vocab_size = rows, max_seq_len, V
        self.runner_options = RunnerOptions(compile=False)
        self._init_session()

    def get_tokenizer(self):
        return None

    def prefill_at(self, tokens, lengths, start):
        return self.model.logits[: tokens.shape[0]]

    def prefill(self, input_ids, lengths=None, **kw):
        return self.model.logits[: input_ids.shape[0]]


def time_scheduler(rows: int, steps: int) -> float:
    eng = StubEngine(rows, steps + 64)
    s = Scheduler(eng, max_prefill_tokens=4096)
    for _ in range(rows):
        s.submit(Request([1, 2, 3], max_tokens=steps + 16))
    for _ in range(8):  # prefill and fill the pipeline
        s.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        s.step()
    dt = (time.perf_counter() - t0) / steps
    assert s.stats.decode_rows >= rows * steps
    return dt


def time_step_alone(rows: int, steps: int) -> float:
    """The stub's decode step (runner.launch: the sampler op, the buffers) with no scheduler around it."""
    eng = StubEngine(rows, steps + 64)
    runner = eng.runner()
    pos = torch.zeros(rows, dtype=torch.long)
    runner.launch(rows, pos)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.launch(rows, pos).tolist()
    return (time.perf_counter() - t0) / steps


def time_static(rows: int, steps: int) -> float:
    eng = StubEngine(rows, steps + 64)
    res = generate(eng, [[1, 2, 3]] * rows, max_new_tokens=steps)
    return res.decode_seconds / max(1, res.decode_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'rows':>5} {'scheduler µs/iter':>18} {'stub step µs':>13} {'scheduler own µs':>17} "
          f"{'static loop µs/step':>20} {'sched/static':>13} {'own <= 50 µs':>13}")
    for rows in (int(r) for r in args.rows.split(",")):
        sch, alone = time_scheduler(rows, args.steps), time_step_alone(rows, args.steps)
        static = time_static(rows, args.steps)
        own = sch - alone
        print(f"{rows:>5} {1e6 * sch:>18.1f} {1e6 * alone:>13.1f} {1e6 * own:>17.1f} {1e6 * static:>20.1f} "
              f"{sch / static:>13.2f} {'met' if own <= 50e-6 else 'not met':>13}")


if __name__ == "__main__":
    main()
