"""`torchrun --nproc-per-node 2` on the CPU (gloo): expert parallelism end to end. A tiny checkpoint in each layout
gives the single-process logits (<= 1e-5, fp32) at prefill and over 100 decode steps, eager (and, the first layout,
with the decode step compiled whole); the CLI prints the single-process greedy text (rank 0 only)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_model.checkpoint.writer import write_tiny_checkpoint

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STEPS = 100
LAYOUTS = ("dsv4", "hf", "official", "modelopt")


def _torchrun(*args, timeout=600, ranks=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={"GLOO_SOCKET_IFNAME": "lo", **os.environ, "PYTHONPATH": f"{ROOT}:{HERE}",
                               "OMP_NUM_THREADS": "1"})  # one host: gloo over loopback


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tr")
    for layout in LAYOUTS:
        write_tiny_checkpoint(root / layout, layout, seed=4, num_shards=2)
    return root


def test_expert_parallel_logits_equal_one_process(ckpts, tmp_path):
    import ep_worker

    paths = [str(ckpts / layout) for layout in LAYOUTS]
    run = _torchrun(str(HERE / "ep_worker.py"), str(tmp_path / "out.pt"), str(STEPS), *paths)
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    for p in paths:
        torch.set_num_threads(1)
        ref = ep_worker.logits(ep_worker.load(p), STEPS, compiled=False)
        for compiled in (False, True) if p == paths[0] else (False,):
            torch.testing.assert_close(got[(p, compiled)], ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{Path(p).name} compiled={compiled}: {m}")


@pytest.mark.parametrize("speculate", [[], ["--speculate", "2", "--temperature", "0.7", "--seed", "3"]],
                         ids=["plain", "speculate"])
def test_the_cli_under_torchrun_prints_the_single_process_text(ckpts, speculate):
    """speculate: the scheduler's speculative steps (sampled) travel to rank 1 in the step plans."""
    args = ["-m", "dsv4_model", "generate", "--model", str(ckpts / "official"), "--prompt", "hello",
            "--max-new-tokens", "16", "--device", "cpu", "--threads", "1", *speculate]
    single = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert single.returncode == 0, single.stderr[-2000:]
    ep = _torchrun(*args)
    assert ep.returncode == 0, ep.stderr[-2000:]
    assert ep.stdout == single.stdout and len(single.stdout) > len("hello\n")  # one copy: rank 0's
    assert "expert parallel over 2 ranks" in ep.stderr


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_dspark_speculation_under_torchrun_gives_the_single_process_run(tmp_path, quant):
    """A tiny 0731-layout checkpoint (DSpark under mtp.*): its stages' experts sharded like the main model's, the
    drafts identical on both ranks (the speculation line's figures are the single process's) and the text plain
    greedy's."""
    from dsv4_model.checkpoint.writer import canonical_weights, write_checkpoint
    from tests.test_release_0731 import _dspark_cfg

    cfg = _dspark_cfg()
    path = write_checkpoint(canonical_weights(cfg, seed=5), cfg, tmp_path / "d0731", "official")
    args = ["-m", "dsv4_model", "generate", "--model", str(path), "--prompt", "hello", "--max-new-tokens", "24",
            "--device", "cpu", "--threads", "1", "--dtype", "float32", "--quant", quant]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    single = subprocess.run([sys.executable, *args, "--speculate", "2"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=env)
    assert plain.returncode == 0 and single.returncode == 0, (plain.stderr + single.stderr)[-2000:]
    ep = _torchrun(*args, "--speculate", "2")
    assert ep.returncode == 0, ep.stderr[-2000:]
    assert ep.stdout == single.stdout == plain.stdout and len(plain.stdout) > len("hello\n")

    def spec(run):
        return [ln for ln in run.stderr.splitlines() if "speculation:" in ln]

    assert len(spec(single)) == 1 and spec(ep) == spec(single)
    assert "DSpark speculate 2" in ep.stderr and "expert parallel over 2 ranks" in ep.stderr


def test_experts_that_do_not_split_evenly_are_refused_in_one_line(ckpts):
    run = _torchrun("-m", "dsv4_model", "generate", "--model", str(ckpts / "dsv4"), "--prompt", "hi", "--device",
                    "cpu", ranks=3)
    assert run.returncode != 0 and run.stdout == ""
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert lines and all(ln == "error: expert parallelism over 3 ranks needs n_routed_experts divisible by 3, got 8"
                         for ln in lines), run.stderr[-2000:]
    assert "dsv4_model/" not in run.stderr  # no frame of ours (the launcher reports the failed ranks its own way)


def test_the_parallel_decode_bench_runs_under_torchrun():
    run = _torchrun(str(ROOT / "bench" / "bench_parallel_decode.py"), "--preset", "tiny", "--device", "cpu",
                    "--batches", "1,2", "--context", "64", "--steps", "3")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "over 2 rank(s)" in run.stdout
    table = [ln.split() for ln in run.stdout.splitlines() if ln.strip()[:1].isdigit() and "layers" not in ln]
    assert [int(r[0]) for r in table] == [1, 2] and all(float(r[1]) > 0 for r in table)
    assert all(r[-1] == "yes" for r in table)  # the ranks hold the same logits


def test_expert_parallel_ranks_pick_kernels_without_timing_them(tmp_path):
    """Under expert parallelism Inductor's deterministic mode is on (each rank timing its own reduction configs
    could keep different ones: last-bit differences in the replicated activations, then different experts picked
    on different ranks at a near-tie); a group of one leaves Inductor as it is."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sys, torch, torch._inductor.config as c\n"
                     "from dsv4_model.runtime import distributed as d\n"
                     "before = c.deterministic\n"
                     "_, shard = d.init_expert_parallel(torch.device('cpu'))\n"
                     "open(f'{sys.argv[1]}/rank{shard.rank}.txt', 'w').write(\n"
                     "    f'rank {shard.rank} of {shard.world} deterministic {before} {c.deterministic}')\n"
                     "d.shutdown()\n"
                     "d.exit_rank(0)\n")
    for ranks in (2, 1):
        out = tmp_path / f"world{ranks}"
        out.mkdir()
        run = _torchrun(str(probe), str(out), ranks=ranks, timeout=120)  # (each rank its own file: the ranks'
        assert run.returncode == 0, run.stderr[-2000:]                    # stdout lines interleave)
        got = sorted(f.read_text() for f in out.iterdir())
        assert got == [f"rank {r} of {ranks} deterministic False {ranks > 1}" for r in range(ranks)], got


@pytest.mark.parametrize("wire", ["group", "separate"])
def test_scheduler_under_torchrun_rank0_decides(ckpts, tmp_path, wire):
    """Rank 0's Scheduler broadcasts each iteration's plan; rank 1 runs it (step_plan.follow): staggered requests,
    more than rows, one cancelled, give the single process's tokens; a scored prompt its log-probabilities; a prompt
    continuing from a prefix snapshot (the row copies in the plans) the same. The plans travel through the gloo
    group itself, or through a gloo group of their own (as over NCCL)."""
    import sched_worker

    path = str(ckpts / "hf")
    run = _torchrun(str(HERE / "sched_worker.py"), str(tmp_path / "out.pt"), path, wire)
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    torch.set_num_threads(1)
    want = sched_worker.run(sched_worker.engine(path))
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert want[4][1] == "cancelled" and all(w[1] == "length" for w in want[:4] + want[5:])
    assert [w[3] for w in want[5:]] == [0, len(sched_worker.SHARED)] == [g[3] for g in got[5:]]
    assert len(want[2][2]) == len(sched_worker.PROMPTS[2]) - 1 and want[2][2] == pytest.approx(got[2][2], abs=1e-4)


def test_parallel_greedy_check_agrees_across_ranks_and_names_a_difference(tmp_path):
    """bench/parallel_greedy.py (issue #32's 1-GPU vs N-GPU check, here on gloo): the random preset built with one
    process and with two expert-parallel ranks gives the same tokens and logits bit for bit; a run whose tokens
    differ is named with the step and rows where they part, and fails."""
    script = str(ROOT / "bench" / "parallel_greedy.py")
    small = ["--preset", "tiny", "--experts", "8", "--steps", "10", "--prompt-len", "20", "--device", "cpu"]
    one = subprocess.run([sys.executable, script, *small, "--out", str(tmp_path / "one.pt")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _torchrun(script, *small, "--out", str(tmp_path / "two.pt"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("world 2, tokens") == 1  # rank 0 alone prints and saves
    cmp = subprocess.run([sys.executable, script, "--compare", str(tmp_path / "one.pt"), str(tmp_path / "two.pt")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 0 and "tokens equal: yes" in cmp.stdout and "(bit for bit)" in cmp.stdout, cmp.stdout
    res = torch.load(tmp_path / "two.pt")
    res["tokens"][1, 3] += 1
    torch.save(res, tmp_path / "bad.pt")
    cmp = subprocess.run([sys.executable, script, "--compare", str(tmp_path / "one.pt"), str(tmp_path / "bad.pt")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 1 and "tokens equal: NO (first difference at step 3: rows [1])" in cmp.stdout, cmp.stdout


def test_the_parallel_decode_bench_says_why_it_stops():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_parallel_decode.py"), "--preset", "tiny",
                          "--device", "cpu", "--experts", "fit"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "--experts fit needs a CUDA device" in run.stderr, run.stderr[-2000:]
