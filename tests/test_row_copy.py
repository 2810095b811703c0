"""Row moves over every row-state buffer (dsv4_model/model/row_copy.py) against the one-buffer-at-a-time gather +
scatter they replace, on buffers of every dtype the caches hold."""
import pytest
import torch

from dsv4_model.model.row_copy import RowMoves


def _buffers(rows=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [f(rows, 3, 4), f(rows, 7).to(torch.bfloat16), f(rows, 2, 8).to(torch.float8_e4m3fn),
            torch.randint(-9, 9, (rows, 6), generator=g, dtype=torch.int32), f(rows, 5),
            torch.randint(0, 255, (rows, 16), generator=g).to(torch.uint8), f(rows, 2, 2).to(torch.bfloat16)]


def _bits(bufs):
    return [b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b for b in bufs]


def _gather_scatter(bufs, src, dst):
    s, d = torch.tensor(src), torch.tensor(dst)
    for b in bufs:
        b.view(torch.uint8).index_copy_(0, d, b.view(torch.uint8).index_select(0, s))


@pytest.mark.parametrize("src, dst", [([0], [1]), ([3, 1], [0, 4]), ([0, 1], [1, 2]), ([2, 0], [0, 2]), ([], [])])
def test_copies_read_every_source_before_writing(src, dst):
    """Chained plans ([0, 1] -> [1, 2]: row 2 gets row 1 as it was) and exchanges ([2, 0] -> [0, 2]) as the gather
    + scatter gives them; only destination rows change. Twice on one RowMoves: its cached views stay right."""
    got, want, moves = _buffers(), _buffers(), RowMoves()
    for _ in range(2):
        moves.copy(got, src, dst)
        if src:
            _gather_scatter(want, src, dst)
        for a, b in zip(_bits(got), _bits(want), strict=True):
            assert torch.equal(a, b)


def test_swaps_exchange_rows_and_leave_the_others():
    got, orig = _buffers(), _buffers()
    RowMoves().swap(got, [3, 0], [1, 4])
    perm = [4, 3, 2, 1, 0]  # row r of got is row perm[r] of orig
    for a, b in zip(_bits(got), _bits(orig), strict=True):
        assert torch.equal(a, b[perm])


def test_saved_rows_come_back():
    bufs, orig, moves = _buffers(), _buffers(), RowMoves()
    held = moves.save(bufs, [2, 4])
    for b in bufs:
        b.view(torch.uint8).fill_(0)
    moves.restore(bufs, [2, 4], held)
    for a, b in zip(_bits(bufs), _bits(orig), strict=True):
        assert torch.equal(a[[2, 4]], b[[2, 4]]) and not a[[0, 1, 3]].view(torch.uint8).any()


def test_a_new_buffer_list_is_never_moved_through_old_views():
    """Reallocated buffers (setup_runtime, a move to another device) are other tensors: the views cached for the
    old list must not be used for them."""
    moves, old, new, want = RowMoves(), _buffers(), _buffers(seed=1), _buffers(seed=1)
    moves.copy(old, [0], [1])
    kept = [b.clone() for b in old]
    moves.copy(new, [2], [3])
    _gather_scatter(want, [2], [3])
    for a, b in zip(_bits(new), _bits(want), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_bits(old), _bits(kept), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("call", [lambda m, b: m.copy(b, [0, 1], [2]), lambda m, b: m.copy(b, [0, 1], [2, 2]),
                                  lambda m, b: m.swap(b, [0, 1], [1, 2]), lambda m, b: m.swap(b, [0, 0], [1, 2]),
                                  lambda m, b: m.restore(b, [0], m.save(b, [0, 1]))])
def test_mismatched_moves_are_refused(call):
    with pytest.raises(ValueError, match="row|restore"):
        call(RowMoves(), _buffers())


def test_moves_of_no_rows_do_nothing():
    bufs, orig, moves = _buffers(), _buffers(), RowMoves()
    moves.copy(bufs, [], [])
    moves.swap(bufs, [], [])
    moves.restore(bufs, [], moves.save(bufs, []))
    for a, b in zip(_bits(bufs), _bits(orig), strict=True):
        assert torch.equal(a, b)


def test_a_model_moves_the_rows_of_its_current_caches():
    """Transformer.copy_rows_ after setup_runtime reallocated the caches moves the new ones (the buffer places are
    found once per setup_runtime); the compressor states' save / restore round trip."""
    from dsv4_model.checkpoint.writer import TINY_CONFIG
    from dsv4_model.model.config import ModelConfig
    from dsv4_model.model.transformer import Transformer

    model = Transformer(ModelConfig(**TINY_CONFIG).validate(), max_batch_size=3, max_seq_len=64, dtype=torch.float32)
    for _ in range(2):
        bufs = model.row_state_buffers()
        for b in bufs:
            for r in range(3):
                b[r].fill_(float(r + 1))
        model.copy_rows_([2], [0])
        assert all(float(b[0].flatten()[0]) == 3.0 and float(b[1].flatten()[0]) == 2.0 for b in bufs)
        saved = model.save_compressor_rows([1])
        states = [b for n, b in model.named_buffers() if n.endswith(("kv_state", "score_state"))]
        for b in states:
            b[1].fill_(9.0)
        model.restore_compressor_rows([1], saved)
        assert states and all(float(b[1].flatten()[0]) == 2.0 for b in states)
        model.setup_runtime()
        assert all(a is not b for a, b in zip(bufs, model.row_state_buffers()))


@pytest.mark.cuda
def test_cuda_moves_give_the_cpu_rows():
    """On the GPU the multi-tensor copies (fused per dtype there) move the same rows as on the CPU."""
    cpu = _buffers()
    gpu = [b.cuda() for b in _buffers()]
    for bufs in (cpu, gpu):
        moves = RowMoves()
        moves.copy(bufs, [0, 1], [1, 2])
        moves.swap(bufs, [3], [0])
        held = moves.save(bufs, [4])
        bufs[0][4].fill_(0)
        moves.restore(bufs, [4], held)
    for a, b in zip(_bits(cpu), _bits(gpu), strict=True):
        assert torch.equal(a, b.cpu())
