"""`torchrun -m dsv4_model serve`: rank 0 serves HTTP and schedules, rank 1 runs its broadcast plans (expert
parallelism, gloo on the CPU); answers equal the single process's, an idle spell longer than the heartbeat is
survived, and SIGTERM to rank 0 ends both ranks and torchrun with 0."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import torch

from dsv4_model.checkpoint.writer import write_tiny_checkpoint
from dsv4_model.runtime.engine import Engine
from helpers.serve_proc import wait_listening

ROOT = Path(__file__).resolve().parent.parent


def test_serve_under_torchrun(tmp_path):
    ckpt = tmp_path / "tiny"
    write_tiny_checkpoint(ckpt, "hf", seed=4, num_shards=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "dsv4_model", "serve", "--model", str(ckpt), "--port", "0", "--device", "cpu", "--dtype", "float32",
           "--max-batch-size", "2", "--max-seq-len", "128", "--threads", "1", "--log-level", "warning"]
    env = {"GLOO_SOCKET_IFNAME": "lo", **os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, pid = wait_listening(proc)
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        prompts = [[1, 5, 9, 13], [1, 17, 3, 3, 3, 20]]
        got = [c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
        time.sleep(6.5)  # past the idle heartbeat (5 s): rank 1 still follows
        again = c.completions.create(model="tiny", prompt=prompts[0], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    torch.set_num_threads(1)
    eng = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=128,
                                 quant="none", progress=False)
    tok = eng.get_tokenizer()
    want = [tok.decode(eng.generate([p], max_new_tokens=12).token_ids[0]) for p in prompts]
    assert got == want and again == want[0] and all(want)
