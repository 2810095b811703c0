"""NVFP4 heads. The drafters' head (Engine.set_draft_head / transformer.attach_draft_head): an NVFP4 copy of the
model's head that the MTP block and DSpark draft with, while verification reads the stored head; its logits are the
W4A16 product of the dequantized copy in fp32; greedy speculation with it gives the plain greedy tokens (tiny model
over window wraps and compression boundaries; the built-in model, its drafts still mostly accepted). The model's
own head in NVFP4 (head_quant / --head-quant): the same module in place of the stored head. The refusals."""
import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from dsv4_model.model import mtp
from dsv4_model.model.layers import hc_head
from dsv4_model.model.transformer import attach_draft_head, draft_head
from dsv4_model.quant.nvfp4_modules import dequantized_weight, nvfp4_draft_head

from helpers.speculative_greedy import speculative_greedy
from test_default_model import ASSETS, needs_assets
from test_speculative import CFG, N, _greedy, _model


@pytest.fixture(scope="module")
def tiny():
    prompt = torch.randint(0, CFG.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([13, 9])
    return prompt, lengths, _greedy(_model(0), prompt, lengths)


def test_draft_logits_are_the_nvfp4_copys_product():
    m = _model(1)
    lin = nvfp4_draft_head(m.head)
    assert lin.weight_packed.numel() * 4 <= m.head.weight.numel() * m.head.weight.element_size()  # <= 1/4 the bytes
    attach_draft_head(m, lin)
    assert draft_head(m) is lin and "draft_head" not in dict(m.named_modules())  # not a submodule
    assert not any(k.startswith("draft_head") for k in m.state_dict())
    blk = m.mtp[0]
    h = torch.randn(2, 3, m.config.hc_mult, m.config.dim, generator=torch.Generator().manual_seed(2))
    got = blk._logits(m, h)
    y = blk.norm(hc_head(h, blk.hc_head_fn, blk.hc_head_scale, blk.hc_head_base, m.config.hc_eps,
                         m.config.norm_eps))
    # the op: bf16 activations, the dequantized NVFP4 weight, fp32 sums written as fp32 (no bf16 rounding)
    want = y.to(torch.bfloat16).float() @ dequantized_weight(lin).T
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, got.to(torch.bfloat16).float())  # not rounded to bf16 on the way
    attach_draft_head(m, None)
    assert draft_head(m) is m.head
    assert not torch.equal(blk._logits(m, h), got)  # the copy is not the stored head


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_speculation_with_the_nvfp4_draft_head_gives_the_plain_tokens(tiny, k):
    prompt, lengths, want = tiny
    m = _model(k)
    attach_draft_head(m, nvfp4_draft_head(m.head))
    got, stats = speculative_greedy(m, prompt, N, k, lengths)
    assert got == want and stats.tokens_per_step >= 1.0


@needs_assets
def test_the_built_in_model_drafts_with_the_nvfp4_head():
    """The shipped model's MTP drafts through the NVFP4 copy: the greedy tokens of plain decode, exactly, with
    most first drafts still accepted (eval/mtp_acceptance.py --draft-head nvfp4 measures the rates)."""
    from dsv4_model.checkpoint.tokenizer import load_tokenizer
    from dsv4_model.runtime.engine import Engine

    eng = Engine.from_pretrained(ASSETS, device="cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=512,
                                 progress=False, compile=False, spare_window_slots=1)
    m = eng.model
    tok = load_tokenizer(ASSETS, m.config)
    ids = [tok.encode(t) for t in ("def fibonacci(n):\n", "import os\nclass Path:\n")]
    L = max(map(len, ids))
    prompt = torch.tensor([i + [0] * (L - len(i)) for i in ids])
    lengths = torch.tensor([len(i) for i in ids])
    want = _greedy(m, prompt, lengths, 120)
    eng.set_draft_head("nvfp4")
    got, stats = speculative_greedy(m, prompt, 120, 1, lengths)
    assert got == want
    assert stats.acceptance()[0] > 0.5
    eng.set_draft_head("stored")
    assert draft_head(m) is m.head


def test_engine_refusals():
    from dsv4_model.runtime.engine import Engine

    eng = Engine(_model(1))
    with pytest.raises(ValueError, match="draft_head must be one of"):
        eng.set_draft_head("fp8")
    eng.set_draft_head("nvfp4")
    with pytest.raises(ValueError, match="NVFP4 already"):
        nvfp4_draft_head(draft_head(eng.model))


def test_cli_draft_head_without_speculate_is_one_line_exit_2():
    from dsv4_model.runtime import cli

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(["generate", "--device", "cpu", "--prompt", "x", "--draft-head", "nvfp4"])
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert rc == 2 and out.getvalue() == "" and len(lines) == 1, err.getvalue()
    assert "--draft-head nvfp4" in lines[0] and "needs --speculate K" in lines[0]


def test_cli_and_engine_agree_on_the_kinds():
    import argparse

    from dsv4_model.runtime.cli import add_dspark_args
    from dsv4_model.runtime.engine import DRAFT_HEADS

    p = argparse.ArgumentParser()
    add_dspark_args(p)
    action = next(a for a in p._actions if a.dest == "draft_head")
    assert tuple(action.choices) == DRAFT_HEADS


def test_mtp_module_reads_the_drafters_head(monkeypatch):
    """mtp.decode_tokens (a step's drafting) goes through the drafters' head: a stand-in head's logits come out."""
    m = _model(1)

    class Marked(torch.nn.Module):
        def forward(self, x):
            return torch.full((*x.shape[:-1], m.config.vocab_size), 7.0)

    attach_draft_head(m, Marked())
    h = torch.randn(2, 1, m.config.hc_mult, m.config.dim)
    logits, _ = mtp.decode_tokens(m, h, torch.tensor([[1], [2]]), torch.tensor([20, 30]))
    assert torch.equal(logits, torch.full_like(logits, 7.0))


@needs_assets
def test_head_quant_puts_the_same_nvfp4_head_in_place():
    """head_quant="nvfp4": the head's float weight is gone, its NVFP4 bytes are the drafters' copy's, and the
    model's logits are that module's on the same streams (fp32, not bf16-rounded); drafting with "nvfp4" then
    reads the head itself."""
    from dsv4_model.quant.nvfp4_modules import is_nvfp4
    from dsv4_model.runtime.engine import Engine

    kw = dict(device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=64, progress=False, compile=False)
    plain = Engine.from_pretrained(ASSETS, **kw)
    quant = Engine.from_pretrained(ASSETS, head_quant="nvfp4", **kw)
    copy = nvfp4_draft_head(plain.model.head)
    head = quant.model.head
    assert is_nvfp4(head) and not hasattr(head, "weight")
    for name in ("weight_packed", "weight_scale", "weight_global_scale"):
        assert torch.equal(getattr(head, name), getattr(copy, name)), name
    ids = torch.tensor([[1, 17, 300, 42, 9, 1000, 5]])
    h = quant.model.streams(ids, torch.tensor([7]))
    got = quant.model._logits(h)
    assert got.dtype == torch.float32 and not torch.equal(got, got.to(torch.bfloat16).float())
    attach_draft_head(plain.model, None)
    plain.model.head = copy
    assert torch.equal(plain.model._logits(h), got)
    quant.set_draft_head("nvfp4")
    assert draft_head(quant.model) is head
    with pytest.raises(ValueError, match="head_quant must be one of"):
        Engine.from_pretrained(ASSETS, head_quant="fp4", **kw)


@needs_assets
def test_cli_head_quant_generates():
    from dsv4_model.runtime import cli

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(["generate", "--device", "cpu", "--prompt", "def f(x):", "--max-new-tokens", "8",
                       "--head-quant", "nvfp4", "--json"])
    assert rc == 0, err.getvalue()
    assert len(json.loads(out.getvalue())["ids"]) == 8


def test_mse_scales_never_lose_to_modelopts_block_for_block():
    """quantize_weight_mse (the heads' quantizer): ModelOpt's global scale and format; each block's squared error
    at most quantize_weight's (its scale is among the candidates), the total smaller on weights whose blocks vary;
    passes of rows give the same bytes as one; an all-zero matrix as quantize_weight gives it."""
    from dsv4_model.quant.nvfp4 import quantize_weight, quantize_weight_mse
    from dsv4_ops import reference as ref

    torch.manual_seed(3)
    w = (torch.randn(96, 272) * torch.rand(96, 1) * 3).to(torch.bfloat16)
    w[5, :16] = 0  # an all-zero block
    a, b = quantize_weight(w), quantize_weight_mse(w, rows_per_pass=40)
    assert torch.equal(a[2], b[2]) and [t.dtype for t in a] == [t.dtype for t in b]
    assert [t.shape for t in a] == [t.shape for t in b]
    err = [(ref.nvfp4_gemm_dequant_ref(*q) - w.float()).square().unflatten(-1, (-1, 16)).sum(-1) for q in (a, b)]
    assert bool((err[1] <= err[0]).all()) and float(err[1].sum()) < 0.9 * float(err[0].sum())
    one = quantize_weight_mse(w, rows_per_pass=96)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(b[:2], one[:2]))
    z = torch.zeros(16, 32)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(quantize_weight(z)[:2], quantize_weight_mse(z)[:2]))


def test_a_compiled_draft_step_sees_a_head_attached_after_it_ran():
    """The drafters' head attached after a compiled drafting step ran: the step recompiles and drafts with it (the
    attribute exists from construction, so the first trace guards on it)."""
    m = _model(1)

    class Marked(torch.nn.Module):
        def forward(self, x):
            return torch.full((*x.shape[:-1], m.config.vocab_size), 7.0)

    h = torch.randn(2, 1, m.config.hc_mult, m.config.dim)
    ids, pos = torch.tensor([[1], [2]]), torch.tensor([20, 30])
    torch._dynamo.reset()
    step = torch.compile(lambda h, ids, pos: mtp.decode_tokens(m, h, ids, pos)[0], backend="eager", fullgraph=True)
    assert not torch.equal(step(h, ids, pos), torch.full((2, 1, m.config.vocab_size), 7.0))
    attach_draft_head(m, Marked())
    assert torch.equal(step(h, ids, pos), torch.full((2, 1, m.config.vocab_size), 7.0))


@needs_assets
def test_a_model_with_an_nvfp4_head_is_not_saved(tmp_path):
    from dsv4_model.checkpoint.loader import save_model
    from dsv4_model.runtime.engine import Engine

    eng = Engine.from_pretrained(ASSETS, device="cpu", dtype=torch.float32, max_seq_len=64, progress=False,
                                 compile=False, head_quant="nvfp4")
    with pytest.raises(ValueError, match="the head is NVFP4"):
        save_model(eng.model, eng.config, tmp_path / "out")
    assert not (tmp_path / "out").exists()
