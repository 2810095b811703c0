"""Row moves over every row-state buffer (dsv4_model/model/row_copy.py) against the one-buffer-at-a-time gather +
scatter they replace, on buffers of every dtype the caches hold."""
import pytest
import torch

from dsv4_model.model.row_copy import copy_rows_of_, restore_rows_, save_rows, swap_rows_of_


def _buffers(rows=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [f(rows, 3, 4), f(rows, 7).to(torch.bfloat16), f(rows, 2, 8).to(torch.float8_e4m3fn),
            torch.randint(-9, 9, (rows, 6), generator=g, dtype=torch.int32), f(rows, 5),
            torch.randint(0, 255, (rows, 16), generator=g).to(torch.uint8), f(rows, 2, 2).to(torch.bfloat16)]


def _bits(bufs):
    return [b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b for b in bufs]


@pytest.mark.parametrize("src, dst", [([0], [1]), ([3, 1], [0, 4]), ([0, 1], [1, 2]), ([2, 0], [0, 2]), ([], [])])
def test_copies_read_every_source_before_writing(src, dst):
    """Chained plans ([0, 1] -> [1, 2]: row 2 gets row 1 as it was) and exchanges ([2, 0] -> [0, 2]) as the gather
    + scatter gives them; only destination rows change."""
    got, want = _buffers(), _buffers()
    copy_rows_of_(got, src, dst)
    if src:
        s, d = torch.tensor(src), torch.tensor(dst)
        for b in want:
            b.view(torch.uint8).index_copy_(0, d, b.view(torch.uint8).index_select(0, s))
    for a, b in zip(_bits(got), _bits(want), strict=True):
        assert torch.equal(a, b)


def test_swaps_exchange_rows_and_leave_the_others():
    got, orig = _buffers(), _buffers()
    swap_rows_of_(got, [3, 0], [1, 4])
    perm = [4, 3, 2, 1, 0]  # row r of got is row perm[r] of orig
    for a, b in zip(_bits(got), _bits(orig), strict=True):
        assert torch.equal(a, b[perm])


def test_saved_rows_come_back():
    bufs, orig = _buffers(), _buffers()
    held = save_rows(bufs, [2, 4])
    for b in bufs:
        b.view(torch.uint8).fill_(0)
    restore_rows_(bufs, [2, 4], held)
    for a, b in zip(_bits(bufs), _bits(orig), strict=True):
        assert torch.equal(a[[2, 4]], b[[2, 4]]) and not a[[0, 1, 3]].view(torch.uint8).any()


@pytest.mark.parametrize("call", [lambda b: copy_rows_of_(b, [0, 1], [2]), lambda b: copy_rows_of_(b, [0, 1], [2, 2]),
                                  lambda b: swap_rows_of_(b, [0, 1], [1, 2]),
                                  lambda b: restore_rows_(b, [0], save_rows(b[:2], [0]))])
def test_mismatched_moves_are_refused(call):
    with pytest.raises(ValueError, match="row"):
        call(_buffers())


@pytest.mark.cuda
def test_cuda_moves_give_the_cpu_rows():
    """On the GPU the multi-tensor copies (fused per dtype there) move the same rows as on the CPU."""
    cpu = _buffers()
    gpu = [b.cuda() for b in _buffers()]
    for bufs in (cpu, gpu):
        copy_rows_of_(bufs, [0, 1], [1, 2])
        swap_rows_of_(bufs, [3], [0])
        held = save_rows(bufs, [4])
        bufs[0][4].fill_(0)
        restore_rows_(bufs, [4], held)
    for a, b in zip(_bits(cpu), _bits(gpu), strict=True):
        assert torch.equal(a, b.cpu())
