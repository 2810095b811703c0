"""generate(): ragged batches, stops, streaming, chunking, seeds; the tokenizer wrappers; the CLI."""
import io
import types
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_model.checkpoint.writer import TINY_CONFIG
from dsv4_model.model.config import ModelConfig
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.generate import generate
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights
from dsv4_model.runtime.session import EngineSession, RunnerOptions
from dsv4_model.checkpoint.tokenizer import ByteTokenizer, HFTokenizer, StreamDecoder, load_tokenizer

V = 32


class CountingModel(torch.nn.Module):
    """Logits say 'next token = previous + 1 (mod V)': generations are predictable."""

    def __init__(self, max_batch_size=4, max_seq_len=64):
        super().__init__()
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.register_buffer("seen_positions", torch.zeros(max_batch_size, dtype=torch.long))

    @property
    def device(self):
        return self.seen_positions.device

    def decode_step(self, tokens, positions, options=None):
        self.seen_positions[: tokens.shape[0]].copy_(positions)
        return 10.0 * torch.nn.functional.one_hot((tokens + 1) % V, V).float()


class CountingEngine(EngineSession):
    def __init__(self, max_batch_size=4, max_seq_len=64):
        self.model = CountingModel(max_batch_size, max_seq_len)
        self.config = types.SimpleNamespace(vocab_size=V, bos_token_id=0, eos_token_id=1)
        self.device, self.path = torch.device("cpu"), None
        self.max_batch_size, self.max_seq_len, self.vocab_size = max_batch_size, max_seq_len, V
        self.runner_options = RunnerOptions(compile=False)
        self._init_session()

    def reset(self):
        pass

    def prefill(self, input_ids, lengths):
        last = input_ids[torch.arange(input_ids.shape[0]), lengths - 1]
        return 10.0 * torch.nn.functional.one_hot((last + 1) % V, V).float()


def test_ragged_batch_stops_and_lengths():
    eng = CountingEngine()
    res = generate(eng, [[5], [10, 11, 12], [V - 3]], max_new_tokens=6, stop_token_ids=[9])
    assert res.token_ids[0] == [6, 7, 8]  # stop id 9 ends the row and is not returned
    assert res.token_ids[1] == [13, 14, 15, 16, 17, 18]
    assert res.token_ids[2] == [V - 2, V - 1, 0]  # EOS (config id 1) ends the row
    assert res.finish_reasons == ["stop", "length", "stop"]
    assert res.prompt_lengths == [1, 3, 1]
    # 6 tokens = 1 from prefill + 5 decode steps feeding positions L .. L + 4 of each row
    assert eng.model.seen_positions[:3].tolist() == [1 + 4, 3 + 4, 1 + 4]


def test_streaming_order_and_chunking():
    eng = CountingEngine(max_batch_size=2)
    events = []
    prompts = [[2], [4], [20], [25]]
    res = generate(eng, prompts, max_new_tokens=3, stream=lambda row, t, text: events.append((row, t)))
    assert res.token_ids == [[3, 4, 5], [5, 6, 7], [21, 22, 23], [26, 27, 28]]
    for row, want in enumerate(res.token_ids):
        assert [t for r, t in events if r == row and t is not None] == want
    # the second chunk (rows 2, 3) streams after the first chunk is complete
    first_of_second = min(i for i, (r, _) in enumerate(events) if r >= 2)
    assert all(r < 2 for r, _ in events[:first_of_second]) and len(events[:first_of_second]) == 6


def test_max_seq_len_caps_the_batch():
    eng = CountingEngine(max_seq_len=8)
    res = generate(eng, [[3] * 6, [3]], max_new_tokens=10)
    # the longest prompt (6) leaves positions 6..7: 8 - 6 + 1 = 3 tokens for every row of the batch
    assert [len(t) for t in res.token_ids] == [3, 3]
    assert res.finish_reasons == ["max_seq_len", "max_seq_len"]  # cut short: the caller must say so
    res = generate(eng, [[3] * 6], max_new_tokens=3)
    assert res.finish_reasons == ["length"]  # exactly what was asked for fits: not cut short
    res = generate(eng, [[3] * 8], max_new_tokens=3)  # a prompt that fills the caches: its one sampled token
    assert res.token_ids == [[4]] and res.finish_reasons == ["max_seq_len"]


def test_a_step_past_the_caches_is_refused_on_the_host():
    from dsv4_model.runtime.compiled import DecodeRunner
    from dsv4_model.runtime.sampling import SamplingParams

    model = CountingModel(max_batch_size=2, max_seq_len=8)
    runner = DecodeRunner(model, compile=False)
    with pytest.raises(ValueError, match="outside"):
        runner.begin([3, 9], [SamplingParams(), SamplingParams()])
    runner.begin([3, 6], [SamplingParams(), SamplingParams()])
    runner.step()  # writes positions 3 and 6
    runner.step()  # 4 and 7: the last cache slot
    with pytest.raises(ValueError, match="position 8: the caches hold max_seq_len=8"):
        runner.step()
    assert model.seen_positions[:2].tolist() == [4, 7]  # the refused step never ran


def test_api_arguments_are_checked_before_loading(tmp_path):
    from dsv4_model.checkpoint.writer import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path / "m", "dsv4", seed=0)
    with pytest.raises(ValueError, match="device 'tpu' is not a device"):
        Engine.from_pretrained(tmp_path / "m", device="tpu")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=4096"):
        Engine.from_pretrained(tmp_path / "m", device="cpu", max_seq_len=8192)
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
        Engine.from_pretrained(tmp_path / "m", device="cpu", max_batch_size=0)
    # what HF users pass, and options whose "no" would read as yes: one error naming the argument, no load
    for kw, want in ((dict(dtype=torch.float16), "dtype must be torch.bfloat16 or torch.float32"),
                     (dict(dtype="bfloat16"), "dtype must be"), (dict(compile="no"), "compile must be True"),
                     (dict(simulate_quant="no"), "simulate_quant must be True or False"),
                     (dict(graph_mode="bogus"), "graph_mode must be one of"),
                     (dict(runner_options="x"), "runner_options must be a RunnerOptions")):
        with pytest.raises((ValueError, TypeError), match=want):
            Engine.from_pretrained(tmp_path / "m", device="cpu", **kw)
    with pytest.raises(ValueError, match="path must be a checkpoint directory or a repo id"):
        Engine.from_pretrained(None, device="cpu")
    eng = Engine.from_pretrained(tmp_path / "m", device="cpu", max_seq_len=8192, allow_beyond_max_position=True,
                                 progress=False)
    assert eng.max_seq_len == 8192


def test_bad_arguments():
    eng = CountingEngine()
    with pytest.raises(ValueError):
        generate(eng, [], max_new_tokens=3)
    with pytest.raises(ValueError):
        generate(eng, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError):
        generate(eng, [[1]], top_p=0.0)
    with pytest.raises(ValueError):
        generate(eng, [[1], "text"])
    for kw, want in ((dict(max_new_tokens="4"), "max_new_tokens must be an int >= 1"),
                     (dict(seed=1.5), "seed must be an int"), (dict(top_k=True), "top_k must be an int")):
        with pytest.raises(ValueError, match=want):
            generate(eng, [[1]], **kw)
    with pytest.raises(ValueError, match="token ids must be ints"):
        generate(eng, [[0.0, 5.7]])


# ------------------------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def micro_engine():
    cfg = ModelConfig(**{**TINY_CONFIG, "n_layers": 3, "compress_ratios": [0, 4, 16], "n_mtp_layers": 0,
                         "n_hash_layers": 1, "n_routed_experts": 4}).validate()
    model = Transformer(cfg, max_batch_size=4, max_seq_len=96, dtype=torch.float32, device="cpu")
    return Engine(init_random_weights(model, 3), runner_options=RunnerOptions(compile=False))


PROMPTS = [[0, 5, 6, 7, 8, 9, 10], [0, 11, 12], [0, 40, 41, 42, 43]]


def test_batched_greedy_equals_per_prompt_engine_loop(micro_engine):
    eng = micro_engine
    res = generate(eng, PROMPTS, max_new_tokens=24)
    for p, got in zip(PROMPTS, res.token_ids):
        # independent reference: Engine.prefill / Engine.decode one prompt at a time, argmax on the host
        eng.reset()
        logits = eng.prefill(torch.tensor([p]))
        want = []
        for _ in range(24):
            t = int(logits.argmax(-1))
            if t == eng.config.eos_token_id:
                break
            want.append(t)
            logits = eng.decode(torch.tensor([t]))
        assert got == want


def test_sampling_is_reproducible_and_batch_independent(micro_engine):
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9)
    a = generate(micro_engine, PROMPTS, seed=11, **kw).token_ids
    b = generate(micro_engine, PROMPTS, seed=11, **kw).token_ids
    assert a == b
    alone = generate(micro_engine, PROMPTS[2:], seed=13, **kw).token_ids[0]  # prompt 2 draws with seed + 2
    assert a[2] == alone
    other = generate(micro_engine, PROMPTS, seed=12, **kw).token_ids
    assert other != a
    greedy = generate(micro_engine, PROMPTS, max_new_tokens=16).token_ids
    assert greedy != a


# ------------------------------------------------------------------------------------------- tokenizers
def test_byte_tokenizer_roundtrip_and_stream():
    tok = ByteTokenizer(vocab_size=300, bos_id=0, eos_id=1)
    text = "héllo ✓ wörld\n\tdef f(x):"
    ids = tok.encode(text)
    assert ids[0] == 0 and tok.decode(ids) == text
    sd = StreamDecoder(tok)
    parts = [sd.push(i) for i in ids]
    assert "".join(parts) + sd.flush() == text
    assert all("\ufffd" not in p for p in parts)  # multi-byte characters are held back, not split
    small = ByteTokenizer(vocab_size=96, bos_id=0, eos_id=1)  # tiny vocab: ASCII survives, the rest -> '?'
    assert small.decode(small.encode("ab\nc")) == "ab\nc"
    assert small.decode(small.encode("é")) == "??"
    assert max(small.encode("~ \x7f")) < 96


def _bpe_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["def fibonacci(n):\n    return n", "héllo wörld ✓ ✓"] * 20, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))


def test_hf_tokenizer_bos_and_streaming(tmp_path):
    _bpe_tokenizer(tmp_path)
    cfg = types.SimpleNamespace(vocab_size=300, bos_token_id=0, eos_token_id=1)
    tok = load_tokenizer(tmp_path, cfg)
    assert isinstance(tok, HFTokenizer)
    text = "def fibonacci(n): héllo ✓"
    ids = tok.encode(text)
    assert ids[0] == 0 and ids[1] != 0  # exactly one BOS
    assert tok.decode(ids) == text
    sd = StreamDecoder(tok)
    assert "".join(sd.push(i) for i in ids) + sd.flush() == text
    assert isinstance(load_tokenizer(tmp_path / "missing", cfg), ByteTokenizer)


# ------------------------------------------------------------------------------------------- CLI
def test_cli_default_model_streams(tmp_path, monkeypatch):
    from dsv4_model.checkpoint import builtin
    from dsv4_model.runtime import cli

    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(builtin, "DEFAULT_MODEL_DIR", tmp_path / "no-default-model")
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "5", "--device", "cpu",
                       "--temperature", "0.7", "--seed", "3"])
    assert rc == 0
    assert out.getvalue().startswith("def fibonacci(n):")
    assert "RANDOM tiny checkpoint" in err.getvalue() and "tokens/s" in err.getvalue()
    assert (tmp_path / cli.RANDOM_TINY_NAME / "config.json").is_file()


def test_cli_bad_arguments_fail_cleanly(tmp_path):
    # A user error is one line on stderr and exit code 2, not a traceback.
    from dsv4_model.runtime import cli

    err = io.StringIO()
    with redirect_stderr(err):
        rc = cli.main(["generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu"])  # no checkpoint
    assert rc == 2 and err.getvalue().startswith("error: ") and str(tmp_path) in err.getvalue(), err.getvalue()
    err = io.StringIO()
    with redirect_stderr(err):
        rc = cli.main(["generate", "--prompt", "x", "--max-new-tokens", "0", "--device", "cpu"])
    assert rc == 2 and "--max-new-tokens must be an int >= 1" in err.getvalue(), err.getvalue()


def test_engine_lengths_follow_generate_so_decode_can_continue(tmp_path):
    # after generate(), the engine holds each row's prompt and the ids its decode steps fed: decode() continues
    # where generation stopped, with the logits a plain prefill of the whole sequence gives
    from dsv4_model.checkpoint.writer import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path / "m", "dsv4", seed=0)
    eng = Engine.from_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32, max_seq_len=64, progress=False)
    prompt = [0, 5, 9, 14]
    res = generate(eng, [prompt], max_new_tokens=6)
    gen = res.token_ids[0]
    assert eng.lengths == [len(prompt) + len(gen) - 1]  # the last sampled id is not fed yet
    cont = eng.decode(torch.tensor([gen[-1]]))
    full = Engine.from_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32, max_seq_len=64, progress=False)
    ref = full.prefill(torch.tensor([prompt + gen]))
    torch.testing.assert_close(cont, ref, rtol=1e-4, atol=1e-4)
