"""The built-in default model: its data pipeline, its training script (a few CPU steps on a micro config), its
storage format, and -- once shipped in dsv4_model/assets/default/ -- its held-out perplexity and generation."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
# DSV4_DEFAULT_MODEL_DIR: check another checkpoint directory with the shipped-model tests (e.g. a fresh run)
ASSETS = Path(os.environ.get("DSV4_DEFAULT_MODEL_DIR", ROOT / "dsv4_model" / "assets" / "default"))

def _load_script(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


td = _load_script("train_data", "scripts/train_data.py")  # before the training script, which imports it
train = _load_script("train_default_model", "scripts/train_default_model.py")
evalmod = _load_script("eval_default_model", "eval/eval_default_model.py")


# ---------------------------------------------------------------------------------------------- data
def test_stdlib_file_list_and_split():
    files = td.list_stdlib_files()
    assert len(files) > 300 and files == sorted(files)
    for f in files:
        parts = f.split("/")
        assert not ({"test", "tests", "idle_test", "site-packages"} & set(parts[:-1])), f
        assert not parts[-1].startswith("test_"), f
    split = td.split_files(files)
    assert sorted(split["train"] + split["val"] + split["test"]) == files
    for name, lo, hi in (("test", 0.005, 0.04), ("val", 0.005, 0.04)):
        assert lo < len(split[name]) / len(files) < hi, (name, len(split[name]))
    # the split is a function of the path alone, so one path lands in the same split on every interpreter
    assert all(td.split_of(f) == "test" for f in split["test"])
    assert td.split_of("a/b.py") == td.split_of("a/b.py") and td.split_of("x.py") in ("train", "val", "test")


def test_tokenizer_roundtrip_and_specials():
    texts = td.read_texts(td.split_files(td.list_stdlib_files())["train"][:8])
    tok = td.train_tokenizer(texts, vocab_size=400)
    assert tok.get_vocab_size() <= 400
    for s in ("import os\n\ndef f(x):\n    return x  # ünïcödé ✓\n", "\t\r\n  ", "日本語"):
        enc = tok.encode(s)
        assert enc.ids[0] == td.BOS_ID and td.EOS_ID not in enc.ids
        assert tok.decode(enc.ids) == s
    stream = td.encode_documents(tok, ["a = 1\n", "b = 2\n"])
    assert stream[0] == td.BOS_ID and stream[-1] == td.EOS_ID and int((stream == td.BOS_ID).sum()) == 2


def test_windows_and_sampler():
    stream = torch.arange(1000)
    w = td.eval_windows(stream, 64)
    assert w.shape == (15, 65) and torch.equal(w[1, 0], w[0, -1])
    a = td.WindowSampler(stream, 3, 16, seed=5).next()
    b = td.WindowSampler(stream, 3, 16, seed=5).next()
    assert torch.equal(a, b) and torch.equal(a[:, 1:] - a[:, :-1], torch.ones(3, 16, dtype=torch.long))
    docs = ["x" * 50, "y" * 50, "z" * 50]
    sample = td.heldout_sample(docs, 120)
    assert td.sample_documents(sample)[:2] == docs[:2]


# ---------------------------------------------------------------------------------------------- training pieces
def _micro_model(batch=2, seq=64, vocab=256, seed=0):
    cfg = train.make_config(train.micro_config_fields(vocab))
    model = train.build_model(cfg, batch, seq, torch.device("cpu"))
    assert train.init_parameters(model, cfg, seed) == []
    train.init_hash_tables(model, seed)
    return model, cfg


def test_mxfp4_fake_quant_equals_storage_codec():
    from dsv4_model.quant.formats import dequant_mxfp4, quant_mxfp4

    w = torch.randn(3, 48, 96) * torch.logspace(-3, 1, 96)
    r = train.mxfp4_round(w)
    for e in range(3):
        assert torch.equal(dequant_mxfp4(*quant_mxfp4(w[e]), dtype=torch.float32), r[e])
    assert torch.equal(train.mxfp4_round(r), r)  # idempotent: stored weights re-encode exactly
    assert 0 < (r - w).abs().max() < w.abs().max()


def test_forward_hidden_matches_inference_prefill():
    model, _ = _micro_model()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.prefill(ids, all_logits=True)
        got = train.forward_logits(model, ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_indexer_distillation_trains_only_the_indexer():
    model, _ = _micro_model()
    train.trainable_parameters(model)
    distill = train.IndexerDistill(model)
    assert len(distill.layers) == 1
    distill.active = True
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    train.forward_hidden(model, ids)
    loss = distill.pop_loss()
    assert loss is not None and torch.isfinite(loss) and loss > 0
    loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all(".indexer." in n for n in with_grad), sorted(with_grad)
    assert any("indexer.wq_b" in n for n in with_grad) and any("indexer.compressor" in n for n in with_grad)


def test_training_steps_reduce_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model, cfg = _micro_model(batch=2, seq=32)
    fqs = train.add_expert_qat(model)
    for fq in fqs:
        fq.enabled = True
    named = train.trainable_parameters(model)
    balancer = train.RouterBalancer(model)
    opt = torch.optim.AdamW(train.param_groups(named, 0.0), lr=3e-3)
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    losses = []
    bias_before = [g.bias.clone() for g in balancer.gates]
    for _ in range(12):
        with torch.nn.utils.parametrize.cached():
            h = train.forward_hidden(model, batch[:, :-1])
            loss = F.cross_entropy(train.logits_from_hidden(model, h).flatten(0, 1), batch[:, 1:].flatten())
            mtp = F.cross_entropy(train.mtp_logits(model, h[:, :-1], batch[:, 1:-1]).flatten(0, 1),
                                  batch[:, 2:].flatten())
        train.detach_runtime_buffers(model)
        opt.zero_grad()
        (loss + 0.3 * mtp).backward()
        opt.step()
        balancer.update(1e-3)
        losses.append(loss.item())
    assert all(b.grad_fn is None for b in model.buffers())
    assert losses[-1] < losses[0] - 1.0, losses
    assert any(not torch.equal(a, g.bias) for a, g in zip(bias_before, balancer.gates))


def test_storage_roundtrip_through_the_loader(tmp_path):
    from dsv4_model.checkpoint.loader import load_model, save_model

    model, cfg = _micro_model()
    fqs = train.add_expert_qat(model)
    for fq in fqs:
        fq.enabled = True
    train.remove_expert_qat(model)
    state = train.storage_state_dict(model)
    assert state["layers.0.ffn.experts.3.w2.weight"].dtype == torch.int8
    assert state["layers.0.ffn.experts.3.w2.scale"].dtype == torch.float8_e8m0fnu
    assert state["head.weight"].dtype == torch.bfloat16 and state["layers.1.hc_attn_fn"].dtype == torch.float32
    save_model(train._StoredModel(state), cfg, tmp_path)
    loaded, _ = load_model(tmp_path, dtype=torch.float32, max_batch_size=2, max_seq_len=64, simulate_quant=False,
                           progress=False)
    from dsv4_model.checkpoint.names import official_storage

    ref = model.state_dict()
    for name, t in loaded.state_dict().items():
        if ".ffn.experts." in name or official_storage(name) in ("f32", "i64"):
            assert torch.equal(t, ref[name]), name  # MXFP4-exact experts, exact fp32 / int tensors
        else:
            # bf16-valued compressor projections and head stay bf16 in memory (Transformer.narrow_weights_)
            assert t.dtype == torch.float32 or ".compressor.w" in name or name == "head.weight", (name, t.dtype)
            torch.testing.assert_close(t.float(), ref[name].to(torch.bfloat16).float(), rtol=0, atol=0, msg=name)


def test_training_script_runs_three_cpu_steps(tmp_path):
    log = train.main(["--out", str(tmp_path), "--config", "micro", "--device", "cpu", "--steps", "3",
                      "--batch-size", "2", "--seq-len", "64", "--vocab-size", "320", "--max-files", "6",
                      "--eval-windows", "2", "--sample-chars", "3000", "--log-every", "1", "--minutes", "5"])
    assert log["steps"] == 3 and len(log["train"]) == 3
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["mtp_loss"]) for r in log["train"])
    for f in ("config.json", "tokenizer.json", "train_log.json", "heldout_sample.txt", "model.safetensors"):
        assert (tmp_path / f).is_file(), f
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["bos_token_id"] == td.BOS_ID and cfg["eos_token_id"] == td.EOS_ID and cfg["vocab_size"] <= 320
    ev = evalmod.evaluate(tmp_path, "cpu", seq_len=64, max_windows=2, batch=2, modes=("bf16",), log=lambda *_: None)
    assert math.isfinite(ev["results"]["bf16"]["ppl"])


# ---------------------------------------------------------------------------------------------- shipped model
needs_assets = pytest.mark.skipif(
    not (ASSETS / "config.json").is_file(),
    reason="dsv4_model/assets/default/ is not shipped yet (produced by scripts/train_default_model.py on a GPU)")


def _recorded() -> dict:
    path = ASSETS / evalmod.EVAL_NAME
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `python eval/eval_default_model.py --device cpu --write`")
    ev = json.loads(path.read_text())
    assert ev["sample_sha256"] == evalmod.sample_sha256(ASSETS), "heldout_sample.txt changed since eval.json"
    return ev


def _ci_ppl(mode: str, ev: dict) -> float:
    windows = evalmod.heldout_windows(ASSETS, ev["seq_len"], ev["ci_windows"])
    model = evalmod.load(ASSETS, "cpu", batch=2, seq_len=ev["seq_len"], simulate_quant=ev["simulate_quant"],
                         mode=mode)
    nll, count, _ = evalmod.score(model, windows, 2)
    return math.exp(nll / count)


@needs_assets
def test_shipped_model_heldout_perplexity():
    ev = _recorded()
    want = ev["results"]["bf16"]["ci_ppl"]
    got = _ci_ppl("bf16", ev)
    assert abs(got / want - 1) < 0.02, f"held-out ppl {got:.4f}, recorded {want:.4f}"
    # a trained model, not noise: far below the uniform-vocabulary perplexity
    assert got < json.loads((ASSETS / "config.json").read_text())["vocab_size"] / 50


@needs_assets
def test_shipped_model_nvfp4_w4a16_perplexity():
    ev = _recorded()
    want = ev["results"]["nvfp4_w4a16"]["ci_ppl"]
    got = _ci_ppl("nvfp4_w4a16", ev)
    assert abs(got / want - 1) < 0.02, f"NVFP4 W4A16 held-out ppl {got:.4f}, recorded {want:.4f}"


@needs_assets
def test_shipped_model_generates_eagerly():
    from dsv4_model.runtime.engine import Engine
    from dsv4_model.runtime.generate import generate
    from dsv4_model.checkpoint.tokenizer import load_tokenizer

    engine = Engine.from_pretrained(ASSETS, device="cpu", max_seq_len=128)
    tok = load_tokenizer(ASSETS, engine.config)
    prompt = "import os\n\n\ndef "
    res = generate(engine, [prompt], max_new_tokens=24, temperature=0.0, tokenizer=tok)
    out = res.token_ids[0]
    assert len(out) >= 4 and res.texts[0] == tok.decode(out)
    # greedy decode (cache path) must agree with the teacher-forced full prefill on its own tokens
    ids = torch.tensor([tok.encode(prompt) + out])
    engine.reset()
    logits = engine.prefill(ids, all_logits=True)[0]
    p = len(tok.encode(prompt))
    agree = (logits[p - 1: p - 1 + len(out)].argmax(-1) == torch.tensor(out)).float().mean()
    assert agree >= 0.9, f"decode/prefill greedy agreement {agree:.2f}"


@needs_assets
def test_teacher_forced_paths_helper():
    """tests/helpers/decode_compare.py (the GPU test's path comparison): an eager DecodeRunner fed eager's own ids
    reproduces eager's logits exactly, a runner fed other ids does not, and decidable() excuses exactly the steps
    whose top-2 gap is within twice the drift."""
    from helpers.decode_compare import decidable, eager_decode, fixed_prefix, forced_decode
    from dsv4_model.runtime.engine import Engine
    from dsv4_model.checkpoint.tokenizer import load_tokenizer

    engine = Engine.from_pretrained(ASSETS, device="cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=64)
    tok = load_tokenizer(ASSETS, engine.config)
    prompts = [tok.encode("def fibonacci(n):"), tok.encode("import os\n\n\ndef ")]
    fed, ref = eager_decode(engine, prompts, 6)
    assert fed.shape == (6, 2) and ref.shape == (6, 2, engine.config.vocab_size)
    assert torch.equal(fed[1:], ref[:-1].argmax(-1))  # greedy: each step feeds the previous step's argmax
    got = forced_decode(engine, prompts, fed, compile=False, cuda_graphs=False)
    assert torch.equal(got, ref)
    assert bool(decidable(got, ref).all())
    other = forced_decode(engine, prompts, (fed + 1) % engine.config.vocab_size, compile=False, cuda_graphs=False)
    assert float((other - ref).abs().amax()) > 1.0
    top2 = ref.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    shifted = ref.clone()
    shifted[..., 0] += gap.amax() + 1.0  # a drift larger than every gap: nothing is decidable
    assert not bool(decidable(shifted, ref).any())
    # ids fixed before the first near-tie: all of them without drift, only the first step with a huge one
    assert fixed_prefix(ref, 0.0) == [6, 6]
    assert fixed_prefix(ref, float(gap.amax()) + 1.0) == [1, 1]
    row0 = gap[:, 0]
    k = int(row0.argmin())
    assert fixed_prefix(ref, float(row0[k]) / 2)[0] == k + 1


@needs_assets
def test_the_mtp_block_drafts_the_token_after_next():
    """The shipped model's MTP block (dsv4_model.model.mtp.prefill) reads the main streams at its own position: on
    held-out text its drafts of the token after next agree with the main model's greedy choice at the next position
    (what greedy speculation accepts) far above chance, and feeding it the streams of other positions (shifted by
    5) loses most of that; chained drafts (its own streams into a second pass) still agree often."""
    acc = _load_script("mtp_acceptance", "eval/mtp_acceptance.py")
    from dsv4_model.checkpoint.tokenizer import load_tokenizer
    from dsv4_model.model import mtp
    from dsv4_model.runtime.engine import Engine

    eng = Engine.from_pretrained(ASSETS, device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=512,
                                 progress=False, compile=False)
    m = eng.model
    text = (ASSETS / "heldout_sample.txt").read_text(encoding="utf-8")
    ids = torch.tensor([load_tokenizer(ASSETS, m.config).encode(text)[:512]])
    accepted, eligible, hits, n = acc.window_counts(m, ids, depth=2)
    assert eligible[0] > 100 and accepted[0] / eligible[0] > 0.45, (accepted, eligible)
    assert eligible[1] > 20 and accepted[1] / eligible[1] > 0.25, (accepted, eligible)
    with torch.no_grad():
        h = m.streams(ids, torch.tensor([512]))
        right = mtp.prefill(m, h[:, :-1], ids[:, 1:])[0].argmax(-1)[0]
        shifted = mtp.prefill(m, torch.roll(h[:, :-1], 5, dims=1), ids[:, 1:])[0].argmax(-1)[0]
    text_hits = lambda d: float((d[:-1] == ids[0, 2:]).float().mean())  # noqa: E731
    assert text_hits(right) > 0.25 and text_hits(shifted) < text_hits(right) - 0.08, (text_hits(right),
                                                                                      text_hits(shifted))
