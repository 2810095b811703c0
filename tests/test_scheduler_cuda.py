"""The scheduler on a GPU: the host plans iteration i + 1 while the device runs iteration i, so nothing in an
iteration may wait for the stream (decode steps with rows riding along whose compressor states are saved and
restored, admissions, prompt chunks, first tokens); and the host -> device helpers it relies on make no sync."""
import contextlib

import pytest
import torch

from dsv4_model.checkpoint.builtin import DEFAULT_MODEL_DIR
from dsv4_model.model.to_device import device_longs, to_device
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.sampling import SamplingParams
from dsv4_model.runtime.scheduler import Scheduler

pytestmark = pytest.mark.cuda


class _NoSync:
    """torch raises on any stream / device synchronization inside (event waits are not one)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)


def test_host_values_reach_the_device_without_a_sync():
    x = torch.randn(2048, 2048, device="cuda")
    src = torch.arange(6).view(2, 3)
    with _NoSync():
        for _ in range(8):  # queued work a synchronizing copy would wait for
            x = torch.tanh(x @ x)
        idx = device_longs([5, 2, 9], "cuda")
        t = to_device(src, "cuda")
        strided = to_device(src[:, ::2], "cuda")  # staged contiguous (a strided pinned source would not be)
        src.add_(100)  # the staged copy is the caller's values at the call
    assert idx.dtype == torch.long and idx.tolist() == [5, 2, 9]
    assert strided.tolist() == [[0, 2], [3, 5]]
    assert t.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert torch.equal(device_longs([1, 2], "cpu"), torch.tensor([1, 2]))


def test_decode_iterations_make_no_sync_with_riding_rows():
    eng = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cuda", max_batch_size=8, max_seq_len=256,
                                 progress=False)
    ids = eng.get_tokenizer().encode((DEFAULT_MODEL_DIR / "heldout_sample.txt").read_text())
    s = Scheduler(eng)
    # rows 0-3: prompts of 8-11 tokens and 2 tokens each, then they ride along at positions 9-12 while row 4
    # generates; position 11 closes a window of the ratio-4 compressors, so that row's states are saved + restored
    short = [s.submit(Request(ids[:8 + i], SamplingParams(), 2, ignore_eos=True)) for i in range(4)]
    long = s.submit(Request(ids[100:120], SamplingParams(), 40, ignore_eos=True))
    protected = []
    protect_rows = eng.protect_rows
    eng.protect_rows = lambda rows: protected.append(list(rows)) or protect_rows(rows)
    while s._waiting or s._prefilling:  # the prefill chunk (eager prefill reads routing counts on the host)
        s.step()
    with _NoSync():
        s.run_until_idle()
    assert protected, "no iteration protected a riding row's compressor state"
    assert [len(r.token_ids) for r in short] == [2] * 4 and len(long.token_ids) == 40
    assert long.finish_reason == "length"


def test_admissions_and_prefill_chunks_make_no_sync():
    """With NVFP4 experts (whose prefill routes on the device; the bf16 experts' eager loop reads routing counts
    on the host) every iteration is sync-free: admissions (sampler rows), prompt chunks interleaved with decode
    steps, first tokens, rows ending and new ones taking their place. The same arrivals give the same tokens as
    a run that waits for the device after every iteration (where no copy can race the host's next writes)."""
    eng = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cuda", max_batch_size=4, max_seq_len=256, quant="nvfp4",
                                 progress=False)
    ids = eng.get_tokenizer().encode((DEFAULT_MODEL_DIR / "heldout_sample.txt").read_text())
    specs = [(ids[0:40], SamplingParams(), 30), (ids[200:237], SamplingParams(0.8, 20, 0.9, 7), 12),
             (ids[400:405], SamplingParams(seed=3), 25), (ids[600:650], SamplingParams(0.7, 0, 1.0, 11), 9),
             (ids[800:833], SamplingParams(), 20)]

    def run(sched, reqs, check_sync):
        out = [sched.submit(Request(p, sp, n, ignore_eos=True)) for p, sp, n in reqs[:1]]
        sched.step()  # the first request's first chunk: the others arrive while it runs
        with _NoSync() if check_sync else contextlib.nullcontext():
            out += [sched.submit(Request(p, sp, n, ignore_eos=True)) for p, sp, n in reqs[1:]]
            sched.run_until_idle()
        return out

    s = Scheduler(eng, max_prefill_tokens=16, reuse=False)
    s.on_step = torch.cuda.synchronize  # serial: also the first use of every path (staging sizes, workspaces)
    ref = run(s, specs, False)
    s.on_step = None
    got = run(s, specs, True)
    assert s.stats.prefill_chunks >= 2 * -(-sum(len(p) for p, _, _ in specs) // 16)  # 16-token chunks, twice
    assert [len(r.token_ids) for r in got] == [n for _, _, n in specs]
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
