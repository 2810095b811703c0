"""The scheduler on a GPU: the host plans iteration i + 1 while the device runs iteration i, so nothing in a
decode-only iteration may wait for the stream (rows riding along whose compressor states are saved and restored
included); and the host -> device helpers it relies on make no sync."""
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
        src.add_(100)  # the staged copy is the caller's values at the call
    assert idx.dtype == torch.long and idx.tolist() == [5, 2, 9]
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
