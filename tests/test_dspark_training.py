"""The DSpark training forward (scripts/dspark_training.py) against the inference module (DSpark.commit + draft), fp32
on random weights: at many anchors at once (some before the window fills, some past it) the blocks' logits with the
Markov bias, the confidence and the greedy drafts equal what `draft` gives after `commit` of the same prefix; the
teacher-forced head equals the greedy one where prev is the drafted token; gradients reach every trained
parameter; the main model's take no gradient."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from dsv4_model.model.dspark import DSpark
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import dspark_training as dt  # noqa: E402

from tests.test_dspark import W, _cfg  # noqa: E402  (the same tiny DSpark config and window)


@pytest.fixture(scope="module")
def parts():
    cfg = _cfg()
    model = init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=64, dtype=torch.float32), 3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, cfg.vocab_size, (2, 40), generator=g)
    return cfg, model, ids


def _close(a, b, what):
    err = (a.float() - b.float()).abs().max().item()
    scale = max(1.0, b.float().abs().max().item())
    assert err <= 1e-5 * scale, f"{what}: max |diff| {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("simulate_quant", [False, True])
def test_training_blocks_equal_the_inference_drafts(parts, simulate_quant):
    cfg, model, ids = parts
    d = DSpark(cfg, dtype=torch.float32, max_batch_size=2, simulate_quant=simulate_quant).init_random_weights(4)
    hidden = dt.main_context(model, d, ids)
    last = torch.tensor([[0, 5, W - 1, W + 3, 30], [2, W, W + 1, 21, 33]])  # window partly empty, full, slid
    with torch.enable_grad():
        h, blk, _ = dt.block_streams(d, model, hidden, ids, last, static_moe=True)
        got = dt.greedy_head(d, model, h, blk[:, 0])
        tf_logits, tf_conf = dt.teacher_forced_head(d, model, h, torch.cat([blk[:, :1], got.tokens[:, :-1]], 1))
    A = last.shape[1]
    picked = set()
    for j in range(A):
        lj = last[:, j]
        d.setup_runtime()  # fresh rings: commit the prefix 0 .. last of each row, then draft
        d.commit(hidden, torch.zeros(2, dtype=torch.long), lj + 1, model.rope_main)
        ref = d.draft(model, ids[torch.arange(2), lj + 1], lj)
        for b in range(2):
            n = b * A + j
            _close(got.logits[n], ref.logits[b], f"anchor {j} row {b} logits")
            _close(got.confidence[n], ref.confidence[b], f"anchor {j} row {b} confidence")
            assert torch.equal(got.tokens[n], ref.tokens[b]), (j, b)
            picked.update(ref.tokens[b].tolist())
    assert len(picked) > 5  # drafts vary with the context
    _close(tf_logits, got.logits, "teacher-forced head, prev = the drafts")
    _close(tf_conf, got.confidence, "teacher-forced confidence")


def test_a_wrong_window_is_caught(parts):
    """The comparison can fail: a ring committed one position short gives other logits."""
    cfg, model, ids = parts
    d = DSpark(cfg, dtype=torch.float32, max_batch_size=2, simulate_quant=False).init_random_weights(4)
    hidden = dt.main_context(model, d, ids)
    last = torch.tensor([[W + 3], [21]])
    h, blk, _ = dt.block_streams(d, model, hidden, ids, last, static_moe=True)
    got = dt.greedy_head(d, model, h, blk[:, 0])
    d.setup_runtime()
    d.commit(hidden, torch.zeros(2, dtype=torch.long), last[:, 0], model.rope_main)  # one position short
    ref = d.draft(model, ids[torch.arange(2), last[:, 0] + 1], last[:, 0] - 1)
    assert (got.logits - ref.logits).abs().max() > 1e-3


def test_gradients_reach_every_trained_parameter(parts):
    cfg, model, ids = parts
    d = DSpark(cfg, dtype=torch.float32, max_batch_size=2, simulate_quant=False).init_random_weights(4)
    trained = {n: p.requires_grad_(True) for n, p in d.named_parameters() if not n.endswith("gate.bias")}
    hidden = dt.main_context(model, d, ids)
    last = torch.arange(0, 30, 3).repeat(2, 1)
    ce, bce, acc = dt.dspark_losses(d, model, hidden, ids, last)
    assert ce.shape == acc.shape == (d.block_size,)
    (ce.mean() + bce).backward()
    missing = [n for n, p in trained.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing
    assert all(p.grad is None for p in model.parameters())  # the main model is frozen


def test_train_dspark_writes_what_the_eval_loads(tmp_path):
    """scripts/train_dspark.py on the built-in model for a few seconds: its weights (DSpark.state_dict names,
    mtp.0..2) load into eval/dspark_acceptance.py's DSpark, and the stages started from the MTP block."""
    import train_dspark

    from dsv4_model.checkpoint.loader import load_model

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
    import dspark_acceptance

    log = train_dspark.main(["--out", str(tmp_path), "--minutes", "0.05", "--max-files", "2", "--seq-len", "64",
                             "--batch-size", "2", "--anchors", "8", "--val-windows", "1", "--log-every", "1"])
    assert log["steps"] >= 1 and log["train"] and len(log["val"]) == 2
    model, cfg = load_model(str(train_dspark.DEFAULT), dtype=torch.float32, quant="none", progress=False)
    d = dspark_acceptance.load_dspark(str(tmp_path), cfg, 1)
    assert {k.split(".")[1] for k in d.state_dict()} == {"0", "1", "2"}
    assert list(d.target_layer_ids) == [cfg.n_layers - 3, cfg.n_layers - 2, cfg.n_layers - 1]
    # the router biases are not trained: still the MTP block's
    assert torch.equal(d.mtp[2].ffn.gate.bias, model.mtp[0].ffn.gate.bias)
    # --init continues from a run's output: its first validation is the earlier run's last
    again = train_dspark.main(["--out", str(tmp_path / "more"), "--init", str(tmp_path), "--minutes", "0.01",
                               "--max-files", "2", "--seq-len", "64", "--batch-size", "2", "--anchors", "8",
                               "--val-windows", "1", "--log-every", "1"])
    assert again["val"][0]["acc"] == pytest.approx(log["val"][-1]["acc"], abs=1e-6)
    assert again["val"][0]["ce"] == pytest.approx(log["val"][-1]["ce"], rel=1e-5)
