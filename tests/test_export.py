"""Export -> AOTInductor package -> load in a FRESH process (Python and C++) -> same logits as the eager engine.

One small package per device is compiled and shared by the tests of this module (AOTI compiles cost tens of
seconds each on CPU): a 2-layer CSA + HCA model, fp32, converted to NVFP4 weights (W4A16), so its graphs call
dsv4::nvfp4_linear / nvfp4_moe through AOTI's proxy executor as production packages do. The float model's
prefill (whose MoE export reroutes to the static-shape path) is checked at the ExportedProgram level.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
import zipfile

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_model.checkpoint.writer import make_config
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.generate import generate
from dsv4_model.runtime.session import RunnerOptions
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights
from dsv4_model.quant.quantize_model import quantize_model_
from dsv4_export import metadata as md
from dsv4_export.build import build_package, written_inputs
from dsv4_export.load import ExportedEngine, PackageMismatch
from helpers.greedy import greedy_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_B, MAX_S, BUCKET_S, CHUNK = 2, 32, 16, 8
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [2, 71, 33, 8, 15, 90, 4, 27, 51, 12, 66, 30]]
STEPS = 8


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _python(code: str, **env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=600)


def _make_model(device, nvfp4=True):
    cfg = make_config("tiny", n_layers=2, compress_ratios=[4, 16], n_hash_layers=1, n_mtp_layers=0)
    model = init_random_weights(Transformer(cfg, max_batch_size=MAX_B, max_seq_len=MAX_S, dtype=torch.float32,
                                            device=device, simulate_quant=True), 0)
    return (quantize_model_(model) if nvfp4 else model), cfg


def _build(tmp_path_factory, device, jobs=None, chunks=()):
    model, cfg = _make_model(device)
    path = str(tmp_path_factory.mktemp(f"export_{device}") / "tiny.pt2")
    build_package(model, cfg.to_dict(), path, max_batch_size=MAX_B, max_seq_len=MAX_S, device=device,
                  decode_batches=[MAX_B], prefill_batches=[MAX_B], prefill_lengths=[BUCKET_S], dtype=torch.float32,
                  jobs=jobs, prefill_chunks=chunks)
    return types.SimpleNamespace(path=path, model=model, config=cfg, device=device)


@pytest.fixture(scope="module")
def cpu_pkg(tmp_path_factory):
    # built in two worker processes (a build's path on a machine of 6+ cores; each worker runs the in-process
    # build's loop, export_and_compile, on its share of the entries): the calls are recorded
    import dsv4_export.workers as workers

    real, jobs = workers.export_and_compile_in_workers, []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workers, "export_and_compile_in_workers", lambda *a, **k: jobs.append(k["jobs"]) or real(*a, **k))
        pkg = _build(tmp_path_factory, "cpu", jobs=2, chunks=[CHUNK])
    pkg.worker_jobs = jobs
    return pkg


@pytest.fixture(scope="module")
def cuda_pkg(tmp_path_factory):
    return _build(tmp_path_factory, "cuda")


def _eager_engine(pkg):
    eng = Engine(pkg.model)
    eng.runner_options = RunnerOptions(compile=False, cuda_graphs=False)  # generate(): the plain eager reference
    return eng


def _eager_reference(pkg):
    """Eager engine: prefill both (ragged) prompts, then STEPS greedy decode steps. Returns (logits, fed ids)."""
    eng = _eager_engine(pkg)
    ids = torch.zeros(len(PROMPTS), max(map(len, PROMPTS)), dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        ids[b, : len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in PROMPTS])
    logits = [eng.prefill(ids, lengths=lens).cpu()]
    fed = []
    for _ in range(STEPS):
        nxt = logits[-1].argmax(-1)
        fed.append(nxt.tolist())
        logits.append(eng.decode(nxt).cpu())
    return ids, lens, logits, fed


def _run_fresh(pkg, tmp_path, ids, lens, fed):
    """Loads the package in a new interpreter, replays the same inputs, returns what it saw."""
    inp, out = str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")
    torch.save({"ids": ids, "lens": lens, "fed": fed, "prompts": PROMPTS}, inp)
    r = _python(f"""
        import torch
        torch.set_num_threads({torch.get_num_threads()})  # the eager reference's: a CPU GEMM's sums follow it
        from dsv4_export.load import ExportedEngine
        from tests.helpers.greedy import greedy_ids
        eng = ExportedEngine({pkg.path!r})
        x = torch.load({inp!r})
        before = [c.clone() for c in eng.caches]
        logits = [eng.prefill(x["ids"], lengths=x["lens"]).cpu()]
        written = [s.name for s, a, b in zip(eng.cache_specs, before, eng.caches) if not torch.equal(a, b)]
        for nxt in x["fed"]:
            logits.append(eng.decode(torch.tensor(nxt)).cpu())
        gen = eng.generate(x["prompts"], max_new_tokens={STEPS}).token_ids
        gen_single = eng.generate([x["prompts"][1]], max_new_tokens={STEPS}).token_ids[0]
        greedy = [greedy_ids(eng, p, {STEPS}) for p in x["prompts"]]
        meta = eng.entry_metadata("decode_b{MAX_B}")
        torch.save({{"logits": logits, "written": written, "generate": gen, "gen_single": gen_single,
                    "greedy": greedy, "entry_meta": meta, "caches": [s.name for s in eng.cache_specs]}}, {out!r})
    """)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(out)


# Logits of the package vs the eager engine: Inductor fuses and reorders the float ops around the dsv4 kernels,
# and the NVFP4 linears round their activations to bf16, so an activation can land one bf16 ulp apart (this fp32
# model's CPU decode steps: fp32 ulps, 2.4e-7 measured; another CPU may vectorize otherwise). A CPU prefill is bit
# for bit (_check_against_eager), after other compiles in this process too (build.eager_numerics rebuilds
# Inductor's cached decomposition table).
TOL = {"cpu": 1e-4, "cuda": 2e-2}
CHUNKED_TOL = 5e-3  # a prompt in chunks vs eager's one pass: other sums over the same positions


def _decidable(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose greedy token cannot flip within this row's observed package-vs-eager error."""
    top2 = b.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > 2 * (a - b).abs().amax(dim=-1) + 1e-6


def _check_against_eager(pkg, got):
    ids, lens, ref_logits, fed = _eager_reference(pkg)
    assert len(got["logits"]) == STEPS + 1
    if pkg.device == "cpu":  # ATen's mean / softmax, no inlined constants (build.eager_numerics)
        assert torch.equal(got["logits"][0], ref_logits[0]), float((got["logits"][0] - ref_logits[0]).abs().max())
    for step, (a, b) in enumerate(zip(got["logits"], ref_logits)):
        tol = TOL[pkg.device]
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"step {step}: {m}")
    # Every step is teacher-forced with the same fed ids, so each (step, row) is compared on its own.
    decidable = [_decidable(a, b) for a, b in zip(got["logits"], ref_logits)]
    n_dec = sum(int(d.sum()) for d in decidable)
    assert n_dec >= len(PROMPTS) * (STEPS + 1) // 2, "too many near-ties to compare greedy tokens: change the prompts"
    for step, (a, b, d) in enumerate(zip(got["logits"], ref_logits, decidable)):
        assert torch.equal(a.argmax(-1)[d], b.argmax(-1)[d]), f"step {step}"
    n = next((i for i, d in enumerate(decidable) if not bool(d.all())), len(decidable))
    # Prefill wrote the caches this process owns (explicit inputs mutated in place, not package state); the
    # decode step's scratch buffers (step_scratch.*) only decode writes.
    scratch = set(pkg.model.scratch_buffer_names()) & set(got["caches"])
    assert set(got["written"]) == set(got["caches"]) - scratch and got["written"] and scratch
    # generate() on the package = generate() on the eager engine (both greedy; up to a possible near-tie).
    ref_gen = generate(_eager_engine(pkg), PROMPTS, max_new_tokens=STEPS).token_ids
    assert [g[:n] for g in got["generate"]] == [g[:n] for g in ref_gen]
    assert got["entry_meta"]["dsv4.torch_version"] == torch.__version__
    assert json.loads(got["entry_meta"]["dsv4.config"]) == pkg.config.to_dict()


@pytest.fixture(scope="module")
def cpu_fresh(cpu_pkg, tmp_path_factory):
    ids, lens, _, fed = _eager_reference(cpu_pkg)
    return _run_fresh(cpu_pkg, tmp_path_factory.mktemp("fresh_cpu"), ids, lens, fed)


@pytest.fixture(scope="module")
def cuda_fresh(cuda_pkg, tmp_path_factory):
    ids, lens, _, fed = _eager_reference(cuda_pkg)
    return _run_fresh(cuda_pkg, tmp_path_factory.mktemp("fresh_cuda"), ids, lens, fed)


def test_package_layout_and_metadata(cpu_pkg):
    meta = md.read_from_archive(cpu_pkg.path)
    assert json.loads(meta[md.K_ENTRIES]) == {
        f"decode_b{MAX_B}": {"kind": "decode", "batch": MAX_B, "seq_len": 1},
        f"prefill_b{MAX_B}_s{BUCKET_S}": {"kind": "prefill", "batch": MAX_B, "seq_len": BUCKET_S},
        f"prefill_chunk_b{MAX_B}_s{CHUNK}": {"kind": "prefill_chunk", "batch": MAX_B, "seq_len": CHUNK}}
    caches = json.loads(meta[md.K_CACHES])
    bufs = dict(cpu_pkg.model.named_buffers())
    # Every buffer decode writes is an explicit input: kv caches and compressor states of both layers.
    assert {c["name"] for c in caches} >= {"layers.0.attn.kv_cache", "layers.1.attn.kv_cache",
                                           "layers.0.attn.indexer.kv_cache", "layers.0.attn.compressor.kv_state"}
    for c in caches:
        assert tuple(c["shape"]) == tuple(bufs[c["name"]].shape)
    assert meta[md.K_DEVICE] == "cpu" and meta[md.K_TORCH] == torch.__version__
    assert json.loads(meta[md.K_CONFIG]) == cpu_pkg.config.to_dict()
    assert json.loads(meta[md.K_QUANT]) == cpu_pkg.model.quant_info
    with zipfile.ZipFile(cpu_pkg.path) as z:
        names = z.namelist()
    # Caches are not baked in as constants: the package's .so files are the only large members.
    assert any(f"/data/aotinductor/decode_b{MAX_B}/" in n and n.endswith(".so") for n in names)
    assert any(f"/data/aotinductor/prefill_b{MAX_B}_s{BUCKET_S}/" in n and n.endswith(".so") for n in names)
    stem = cpu_pkg.path[: -len(".pt2")]
    ep = torch.export.load(f"{stem}.decode_b{MAX_B}.ep.pt2")
    assert len(ep.graph_signature.user_inputs) == 2 + len(caches)


def test_fresh_process_matches_eager_engine_cpu(cpu_pkg, cpu_fresh):
    _check_against_eager(cpu_pkg, cpu_fresh)


def test_a_prompt_longer_than_every_bucket_runs_in_chunks(cpu_pkg):
    """Prompts of 21 and 13 tokens (the prefill bucket holds 16): chunks of 8 through prefill_chunk_b2_s8, the
    last padded past the prompt; the logits and the decode steps after them are the eager engine's."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, cpu_pkg.config.vocab_size, (2, 21), generator=g)
    lens = torch.tensor([21, 13])
    pkg, ref = ExportedEngine(cpu_pkg.path), _eager_engine(cpu_pkg)
    a, b = pkg.prefill(ids, lengths=lens), ref.prefill(ids, lengths=lens)
    for step in range(4):
        torch.testing.assert_close(a, b, atol=CHUNKED_TOL, rtol=CHUNKED_TOL, msg=lambda m: f"step {step}: {m}")
        nxt = b.argmax(-1)
        a, b = pkg.decode(nxt), ref.decode(nxt)


def test_decode_step_refuses_bad_inputs_before_the_kernel(cpu_pkg):
    """decode_step's inputs are checked (one ValueError naming tokens / positions) instead of reaching the entry,
    where an int32 or float tensor or an id == vocab_size aborted the process and positions -1 ran."""
    eng = ExportedEngine(cpu_pkg.path, entries=[f"decode_b{MAX_B}"])
    V, L = cpu_pkg.config.vocab_size, torch.long
    tok, pos = torch.zeros(MAX_B, dtype=L), torch.zeros(MAX_B, dtype=L)
    for args, want in [
        ((tok.int(), pos), "tokens must be an int64 tensor [B], got dtype int32"),
        ((tok.float(), pos), "tokens must be an int64 tensor [B], got dtype float32"),
        ((tok.view(-1, 1), pos), f"tokens must be an int64 tensor [B], got shape ({MAX_B}, 1)"),
        ((torch.full((MAX_B,), V), pos), f"tokens contains token id {V} outside [0, vocab_size={V})"),
        ((tok, torch.full((MAX_B,), -1)), f"positions contains position -1 outside [0, max_seq_len={MAX_S})"),
        ((tok, torch.full((MAX_B,), MAX_S)), f"positions contains position {MAX_S} outside [0, max_seq_len={MAX_S})"),
        ((tok, torch.zeros(MAX_B + 1, dtype=L)), f"positions must have the shape of tokens ({MAX_B},), got "
                                                 f"({MAX_B + 1},)"),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(want) + "$"):
            eng.decode_step(*args)
    assert eng.decode_step([1] * MAX_B, list(range(MAX_B))).shape == (MAX_B, V)


def test_the_scheduler_runs_a_package(cpu_pkg):
    """An exported package under the Scheduler (generate() takes this path): 3 requests on 2 rows, staggered, their
    prompts prefilled through the prefill_chunk entry from each row's own position (5 tokens per iteration, so a
    prompt spans chunks while the other row decodes): each gets the tokens the eager engine's scheduler gives it."""
    from dsv4_model.runtime.requests import Request
    from dsv4_model.runtime.sampling import SamplingParams
    from dsv4_model.runtime.scheduler import Scheduler

    prompts = [PROMPTS[0], PROMPTS[1], [7, 3, 19, 44]]
    got = []
    for eng in (ExportedEngine(cpu_pkg.path), _eager_engine(cpu_pkg)):
        s = Scheduler(eng, max_prefill_tokens=5, tokenizer=None)
        reqs = []
        for p in prompts:
            reqs.append(s.submit(Request(p, SamplingParams(), 6, ignore_eos=True)))
            s.step()
        s.run_until_idle()
        assert [r.finish_reason for r in reqs] == ["length"] * 3 and s.stats.prefill_chunks > 3
        got.append([r.token_ids for r in reqs])
    assert got[0] == got[1]


def test_compile_jobs_rule(monkeypatch):
    import dsv4_export.build as b

    model, _ = _make_model("cpu")
    monkeypatch.setattr(b.os, "cpu_count", lambda: 16)
    # 64 GiB free host memory: the cores decide (the rule reads free pages, which vary with the machine's cache)
    monkeypatch.setattr(b.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 64 * 2**18, "SC_PAGE_SIZE": 4096}[name])
    assert b.compile_jobs(None, model, 5, "cpu") == 5 and b.compile_jobs(None, model, 3, "cpu") == 3
    monkeypatch.setattr(b.os, "cpu_count", lambda: 2)
    assert b.compile_jobs(None, model, 5, "cpu") == 1  # the CI machine: in process
    assert b.compile_jobs(4, model, 2, "cpu") == 2
    monkeypatch.setattr(b.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(b.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 3 * 2**18, "SC_PAGE_SIZE": 4096}[name])
    assert b.compile_jobs(None, model, 5, "cpu") == 1  # 3 GiB available: one model copy (+ 1 GiB) per third
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        b.compile_jobs(0, model, 2, "cpu")


def test_package_built_in_worker_processes(cpu_pkg):
    # Decode, prefill and the prefill chunk exported + compiled in two worker processes (the model pickled to
    # them), each entry's ExportedProgram saved beside the package; the tests above run what they built.
    assert cpu_pkg.worker_jobs == [2]
    stem = cpu_pkg.path[: -len(".pt2")]
    entries = json.loads(md.read_from_archive(cpu_pkg.path)[md.K_ENTRIES])
    assert len(entries) == 3
    for entry in entries:
        assert os.path.isfile(f"{stem}.{entry}.ep.pt2"), entry


@pytest.mark.cuda
def test_fresh_process_matches_eager_engine_cuda(cuda_pkg, cuda_fresh):
    _check_against_eager(cuda_pkg, cuda_fresh)
    cap = torch.cuda.get_device_capability()
    assert cuda_fresh["entry_meta"]["dsv4.gpu_arch"] == f"sm_{cap[0]}{cap[1]}"


@pytest.fixture(scope="module")
def runner_bin(tmp_path_factory):
    if shutil.which("cmake") is None or (shutil.which("g++") is None and shutil.which("c++") is None):
        pytest.skip("the C++ runner needs cmake and a C++ compiler")
    build_dir = str(tmp_path_factory.mktemp("dsv4_run"))
    r = subprocess.run(["bash", os.path.join(ROOT, "dsv4_export", "cpp", "build.sh"), build_dir], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout.strip().splitlines()[-1]


def _cpp_greedy(runner_bin, pkg, prompt, n):
    r = subprocess.run([runner_bin, "--ops-lib", dsv4_ops.library_path(), "--max-new-tokens", str(n), pkg.path,
                        *map(str, prompt)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("generated:")]
    assert line, r.stdout
    return [int(t) for t in line[0].split()[1:]]


def test_cpp_runner_matches_python_cpu(cpu_pkg, cpu_fresh, runner_bin):
    # The same artifact with the same (padded) inputs: C++ and Python must agree exactly.
    for prompt, py_ids in zip(PROMPTS, cpu_fresh["greedy"]):
        assert _cpp_greedy(runner_bin, cpu_pkg, prompt, STEPS) == py_ids
    r = subprocess.run([runner_bin, "--ops-lib", dsv4_ops.library_path(), "--metadata", cpu_pkg.path],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    meta = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert meta["dsv4.entry"] == f"decode_b{MAX_B}"
    assert meta["dsv4.torch_version"] == torch.__version__
    assert json.loads(meta["dsv4.config"]) == cpu_pkg.config.to_dict()


def test_cpp_runner_prefills_a_long_prompt_in_chunks(cpu_pkg, runner_bin):
    """A prompt longer than every prefill bucket: the C++ runner's chunks give Python's greedy ids exactly."""
    prompt = [(7 * i + 3) % cpu_pkg.config.vocab_size for i in range(21)]
    assert _cpp_greedy(runner_bin, cpu_pkg, prompt, STEPS) == greedy_ids(ExportedEngine(cpu_pkg.path), prompt, STEPS)


@pytest.mark.cuda
def test_cpp_runner_matches_python_cuda(cuda_pkg, cuda_fresh, runner_bin):
    for prompt, py_ids in zip(PROMPTS, cuda_fresh["greedy"]):
        assert _cpp_greedy(runner_bin, cuda_pkg, prompt, STEPS) == py_ids


def test_cpp_runner_without_op_library_fails_clearly(cpu_pkg, runner_bin):
    r = subprocess.run([runner_bin, cpu_pkg.path, "1", "2"], env={k: v for k, v in os.environ.items()
                                                                   if k != "DSV4_OPS_LIBRARY"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "op library" in r.stderr


@pytest.mark.parametrize("args, want", [
    (["/nonexistent/x.pt2", "1", "2"], "no package at /nonexistent/x.pt2"),
    (["{pkg}", "1", "abc"], "prompt id must be an integer, got 'abc'"),
    (["{pkg}", "1", "-4"], "prompt id -4 outside [0, vocab_size="),
    (["{pkg}", "1", "99999999"], "prompt id 99999999 outside [0, vocab_size="),
    (["--max-new-tokens", "-3", "{pkg}", "1"], "--max-new-tokens must be >= 1, got -3"),
    (["--max-new-tokens", "x", "{pkg}", "1"], "--max-new-tokens must be an integer, got 'x'"),
    (["--max-new-tokens"], "--max-new-tokens needs a value"),
    (["--frobnicate", "{pkg}", "1"], "unknown option --frobnicate"),
    (["{pkg}", *map(str, range(1, 40))], "prompt of 39 ids exceeds the package's max_seq_len 32"),
])
def test_cpp_runner_bad_input_is_one_line_and_exit_2(cpu_pkg, runner_bin, args, want):
    r = subprocess.run([runner_bin, "--ops-lib", dsv4_ops.library_path(), *[a.format(pkg=cpu_pkg.path) for a in args]],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"dsv4_run: error: {r.stderr.split('error: ', 1)[1].strip()}"]
    assert want in r.stderr and r.stdout == ""


def _package_variant(src: str, dst: str, meta: dict | None = None, damage: str | None = None) -> str:
    """A copy of a package with metadata keys replaced (extra/dsv4_metadata.json, what both loaders check first), or
    with one byte of the .so of entry `damage` flipped (same size: only its CRC-32 tells)."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as w:
        for info in z.infolist():
            data = z.read(info.filename)
            if meta and info.filename.endswith("extra/" + md.EXTRA_FILE):
                data = json.dumps(dict(json.loads(data), **meta)).encode()
            w.writestr(info, data)
    if damage:
        with zipfile.ZipFile(dst) as z:
            info = next(i for i in z.infolist() if f"/aotinductor/{damage}/" in i.filename and i.filename.endswith(".so"))
        with open(dst, "r+b") as f:
            f.seek(info.header_offset + 26)
            name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
            f.seek(info.header_offset + 30 + name_len + extra_len + info.file_size // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0xFF]))
    return dst


def test_cpp_runner_refuses_what_python_refuses(cpu_pkg, runner_bin, tmp_path):
    """Package format, the exact torch version (a local part like +cu128 included), a CUDA package without a CUDA
    device, a damaged entry: each one line and exit 2 from dsv4_run, in the words ExportedEngine uses, before the
    entry is loaded (a damaged .so used to run its garbage kernels)."""
    decode = f"decode_b{MAX_B}"
    cases = [({md.K_FORMAT: "2"}, None, "package format '2', this loader reads '1': rebuild it"),
             ({md.K_TORCH: torch.__version__ + ".dev"}, None, f"package built with torch {torch.__version__}.dev, "),
             ({md.K_TORCH: torch.__version__.split("+")[0] + "+other"}, None, "+other, this runner links torch"),
             (None, decode, "damaged package (Bad CRC-32 for file '")]
    if not torch.cuda.is_available():
        cases.append(({md.K_DEVICE: "cuda", md.K_ARCH: "sm_90"}, None,
                      "package built for CUDA, but this process sees no CUDA device"))
    for i, (meta, damage, want) in enumerate(cases):
        pkg = _package_variant(cpu_pkg.path, str(tmp_path / f"v{i}.pt2"), meta, damage)
        r = subprocess.run([runner_bin, "--ops-lib", dsv4_ops.library_path(), pkg, "1", "2"], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and want in r.stderr, (want, r.stderr[-2000:])
        with pytest.raises(PackageMismatch, match=re.escape(want.split(", this runner")[0])):
            ExportedEngine(pkg)


def test_cut_short_by_max_seq_len_the_same_in_python_export_run_and_cpp(cpu_pkg, runner_bin):
    prompt, n = PROMPTS[1], 40  # 12 ids + 40 new > max_seq_len 32: 21 tokens fit
    eng = ExportedEngine(cpu_pkg.path)
    res = eng.generate([prompt], max_new_tokens=n)
    assert res.finish_reasons == ["max_seq_len"] and len(res.token_ids[0]) == MAX_S - len(prompt) + 1
    r = subprocess.run([sys.executable, "-m", "dsv4_export", "run", cpu_pkg.path, "--prompt-ids", *map(str, prompt),
                        "--max-new-tokens", str(n)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [int(t) for t in r.stdout.split("generated:")[1].split()] == res.token_ids[0]
    assert f"cut short after 21 of {n} tokens" in r.stderr and f"max_seq_len={MAX_S}" in r.stderr
    c = subprocess.run([runner_bin, "--ops-lib", dsv4_ops.library_path(), "--max-new-tokens", str(n), cpu_pkg.path,
                        *map(str, prompt)], capture_output=True, text=True, timeout=300)
    assert c.returncode == 0, c.stderr[-3000:]
    assert [int(t) for t in c.stdout.split("generated:")[1].split()] == res.token_ids[0]
    assert f"cut short after 21 of {n} tokens" in c.stderr and f"max_seq_len={MAX_S}" in c.stderr


def test_cli_build_prefill_buckets_cover_max_batch_size(monkeypatch):
    import dsv4_export.__main__ as cli
    import dsv4_export.build

    seen = {}
    monkeypatch.setattr(dsv4_export.build, "build_from_checkpoint", lambda *a, **k: seen.update(k))
    assert cli.main(["build", "--model", "m", "--out", "x.pt2", "--max-batch-size", "2", "--device", "cpu"]) == 0
    assert seen["prefill_batches"] == [1, 2] and seen["decode_batches"] == [1, 2]


def test_cli_run_without_op_library_fails_clearly(cpu_pkg):
    r = subprocess.run([sys.executable, "-m", "dsv4_export", "run", cpu_pkg.path, "--prompt-ids", "1", "2"], cwd=ROOT,
                       env=_env(DSV4_OPS_LIBRARY="/nonexistent/libdsv4_ops.so"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]  # one line, no traceback
    assert "op library" in r.stderr and "DSV4_OPS_LIBRARY=/nonexistent/libdsv4_ops.so" in r.stderr, r.stderr


def test_cli_run_and_info(cpu_pkg, cpu_fresh):
    r = subprocess.run([sys.executable, "-m", "dsv4_export", "run", cpu_pkg.path, "--prompt-ids",
                        *map(str, PROMPTS[1]), "--max-new-tokens", str(STEPS)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ids = [int(t) for t in r.stdout.split("generated:")[1].split()]
    assert ids == cpu_fresh["gen_single"]
    r = subprocess.run([sys.executable, "-m", "dsv4_export", "info", cpu_pkg.path], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"dsv4.torch_version = {torch.__version__}" in r.stdout


def test_mismatched_config_is_refused_before_loading(cpu_pkg):
    other = dict(cpu_pkg.config.to_dict(), dim=128)
    with pytest.raises(PackageMismatch, match="differs in dim"):
        ExportedEngine(cpu_pkg.path, config=other)


def test_metadata_checks_name_the_mismatch(cpu_pkg):
    meta = md.read_from_archive(cpu_pkg.path)
    md.check(meta, device="cpu")
    with pytest.raises(PackageMismatch, match="torch 2.0.0"):
        md.check(dict(meta, **{md.K_TORCH: "2.0.0"}))
    with pytest.raises(PackageMismatch, match="built for cpu, asked to run on cuda"):
        md.check(meta, device="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(PackageMismatch, match="no CUDA device"):
            md.check(dict(meta, **{md.K_DEVICE: "cuda", md.K_ARCH: "sm_90"}))
    else:
        with pytest.raises(PackageMismatch, match="GPU arch sm_10"):
            md.check(dict(meta, **{md.K_DEVICE: "cuda", md.K_ARCH: "sm_10"}))
    with pytest.raises(PackageMismatch, match="GLIBCXX_3.4.999"):
        md.check(dict(meta, **{md.K_CXX_GLIBCXX: "3.4.999"}))
    with pytest.raises(PackageMismatch, match="lacks dsv4::no_such_op"):
        md.check(dict(meta, **{md.K_OPS_USED: json.dumps({"dsv4::no_such_op": "dsv4::no_such_op() -> ()"})}))
    name, schema = next(iter(md.dsv4_schemas().items()))
    with pytest.raises(PackageMismatch, match="schemas changed"):
        md.check_ops({name: schema + " "})


def test_not_a_package_is_refused(tmp_path):
    bogus = tmp_path / "x.pt2"
    with zipfile.ZipFile(bogus, "w") as z:
        z.writestr("x/data/whatever", "1")
    with pytest.raises(PackageMismatch, match="not a dsv4 export package"):
        ExportedEngine(str(bogus))


def test_dsv4_ops_in_the_package_need_the_library(cpu_pkg):
    used = json.loads(md.read_from_archive(cpu_pkg.path)[md.K_OPS_USED])
    assert {"dsv4::nvfp4_linear", "dsv4::nvfp4_moe"} <= set(used)
    assert all(schema == md.dsv4_schemas()[op] for op, schema in used.items())
    # A process that never loaded the op library cannot even load the package: torch cannot resolve the
    # dsv4 calls (this is why ExportedEngine / dsv4_run load the library first).
    r = _python(f"""
        from torch._inductor.package import load_package
        load_package({cpu_pkg.path!r}, "decode_b{MAX_B}")
    """)
    assert r.returncode != 0 and "Could not find schema for dsv4::" in r.stderr, r.stderr[-3000:]


def test_float_model_prefill_exports_through_the_static_moe_path():
    from dsv4_export.build import Entry, _example_inputs, export_entry
    from dsv4_export.entrypoints import cache_names, call_prefill

    model, _ = _make_model("cpu", nvfp4=False)
    entry = Entry(f"prefill_b{MAX_B}_s{BUCKET_S}", "prefill", MAX_B, BUCKET_S)
    names = cache_names(model, probe=lambda: call_prefill(model, *_example_inputs(entry, "cpu")))
    ep = export_entry(model, names, entry, device="cpu")
    tokens = torch.randint(0, 96, (MAX_B, BUCKET_S), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([BUCKET_S, 9])
    tokens[1, 9:] = 0  # what Engine feeds in padding (it also reaches the cache slots past a row's length)
    caches = tuple(torch.zeros_like(model.get_buffer(n)) for n in names)
    got = ep.module()((tokens, lengths), caches)
    ref = Engine(model).prefill(tokens, lengths=lengths)  # eager: the data-dependent per-expert loop
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    for n, c in zip(names, caches):  # the graph wrote the caches it was given, like the eager model
        torch.testing.assert_close(c, model.get_buffer(n), atol=1e-4, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_bf16_nvfp4_decode_exports_the_moe_rows_fold():
    """A bf16 NVFP4 model's decode entry carries the MoE rows into hc_post_pre (nvfp4_moe_rows + out_ids) through
    torch.export; the exported step gives the eager step's logits and cache writes."""
    from dsv4_export.build import Entry, _dsv4_ops_in, _example_inputs, export_entry
    from dsv4_export.entrypoints import cache_names, call_decode

    cfg = make_config("tiny", n_layers=2, compress_ratios=[4, 16], n_hash_layers=1, n_mtp_layers=0)
    model = quantize_model_(init_random_weights(Transformer(cfg, max_batch_size=MAX_B, max_seq_len=MAX_S,
                                                            dtype=torch.bfloat16, simulate_quant=True), 0))
    entry = Entry(f"decode_b{MAX_B}", "decode", MAX_B)
    names = cache_names(model, probe=lambda: call_decode(model, *_example_inputs(entry, "cpu")))
    ep = export_entry(model, names, entry, device="cpu")
    ops = _dsv4_ops_in(ep)
    assert "dsv4::nvfp4_moe_rows" in ops and "out_ids" in ops["dsv4::hc_post_pre"], sorted(ops)
    fold = [n for n in ep.graph.nodes if n.op == "call_function" and str(n.target) == "dsv4.hc_post_pre.default"
            and len(n.args) > 12 and n.args[12] is not None]
    assert len(fold) == cfg.n_layers - 1
    tokens, positions = torch.tensor([3, 5]), torch.tensor([4, 9])
    caches = tuple(torch.zeros_like(model.get_buffer(n)) for n in names)
    got = ep.module()((tokens, positions), caches)
    for n in names:
        model.get_buffer(n).zero_()
    ref = call_decode(model, tokens, positions)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    for n, c in zip(names, caches):
        torch.testing.assert_close(c, model.get_buffer(n), atol=0, rtol=0, msg=lambda m: f"{n}: {m}")


def test_written_inputs_agrees_with_functionalization():
    from dsv4_export.entrypoints import CacheAsInputs, caches_detached, call_decode
    from export_toy import ToyLM

    m = ToyLM(max_batch_size=2, max_seq_len=8)
    names = ["k_cache", "v_cache"]
    caches = tuple(torch.zeros_like(m.get_buffer(n)) for n in names)
    inputs = (torch.tensor([1, 2]), torch.tensor([0, 3]))
    with caches_detached(m, names), torch.no_grad():
        ep = torch.export.export(CacheAsInputs(m, names, call_decode), (inputs, caches), strict=False)
        ro = torch.export.export(CacheAsInputs(m, names, lambda mod, t, p: mod.k_cache[:2, 0] + mod.v_cache[:2, 0]),
                                 (inputs, caches), strict=False)
    functional = set(ep.run_decompositions({}).graph_signature.user_inputs_to_mutate.values())
    assert written_inputs(ep) == functional == set(ep.graph_signature.user_inputs[2:])
    assert written_inputs(ro) == set()


def test_cli_run_text_in_text_out(cpu_pkg):
    """`export run --prompt TEXT` encodes with the tokenizer the package records (build_package without a
    tokenizer.json: the byte-level fallback) and prints prompt + completion as text: the --prompt-ids run's ids."""
    from dsv4_model.checkpoint.tokenizer import load_tokenizer

    tok, prompt = load_tokenizer(None, cpu_pkg.config), "ab c"
    assert md.read_from_archive(cpu_pkg.path)["dsv4.tokenizer"] == "bytes"
    run = [sys.executable, "-m", "dsv4_export", "run", cpu_pkg.path, "--max-new-tokens", str(STEPS)]
    text = subprocess.run([*run, "--prompt", prompt], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    ids = subprocess.run([*run, "--prompt-ids", *map(str, tok.encode(prompt))], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and ids.returncode == 0, text.stderr[-3000:] + ids.stderr[-3000:]
    gen = [int(t) for t in ids.stdout.split("generated:")[1].split()]
    assert text.stdout == prompt + tok.decode(gen) + "\n"
