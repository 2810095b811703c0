"""scripts/gpu_check.sh's parts in a dry run (GPU_CHECK_DRY_RUN=1: each step's command printed, nothing run): every
part parses and exits 0, and every project file a step names exists, so a device call (scarce, ~10 minutes) does
not fail on a typo or a renamed script."""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = sorted(p.stem for p in (ROOT / "scripts" / "gpu").glob("*.sh") if p.stem != "lib")


@pytest.mark.parametrize("part", PARTS)
def test_part_dry_run_names_existing_files(part, tmp_path):
    run = subprocess.run(["bash", "scripts/gpu_check.sh", part], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = run.stdout
    assert f"dry run: {part}" in out
    steps = re.findall(r"^\[[^\]]+\] (?:\d+s: )?(.*)$", out, flags=re.M)
    assert steps, out
    named = set(re.findall(r"\b((?:bench|scripts|tests|eval|dsv4_\w+)/[\w/.-]+\.(?:py|sh))\b", out))
    missing = sorted(f for f in named if not (ROOT / f).exists())
    assert not missing, f"{part}: {missing}"


def test_multigpu_part_compares_one_gpu_with_all_and_runs_the_full_model():
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "multigpu"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": "/tmp/dsv4_dry_multigpu"})
    out = run.stdout
    assert run.returncode == 0, out
    assert re.search(r"\[multigpu_greedy_1\].* bench/parallel_greedy\.py --layers 43 ", out)
    assert re.search(r"\[multigpu_greedy_2\].*torch\.distributed\.run .*--nproc-per-node 2 bench/parallel_greedy", out)
    assert re.search(r"\[multigpu_compare\].*--compare .*greedy_1\.pt .*greedy_2\.pt", out)
    assert re.search(r"\[multigpu_decode_4k\].*bench_parallel_decode\.py --layers 43 .*--batches 1,8,64", out)
    assert re.search(r"\[multigpu_decode_128k\].*--context 131072 --batches 1 --regional", out)


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_profile_step_dry_run_on_the_cpu(drafter, tmp_path):
    """bench/profile_step.py (the speculate part's SPECULATE_PROFILE) on a tiny preset: the plain step's and the
    K = 1 pass's tables and the difference come out for either drafter (DSpark's rows set up by its scheduler)."""
    run = subprocess.run([os.sys.executable, "bench/profile_step.py", "--device", "cpu", "--model", "micro",
                          "--speculate", "1", "--drafter", drafter, "--steps", "1", "--prompt-len", "24", "--top", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for head in ("## plain step:", "## speculative pass, K = 1 (", "## what the pass adds, by kernel"):
        assert head in run.stdout, run.stdout[-2000:]
