"""The README's Python API snippets run as written (from another directory, the repository on the path as an installed
package would be), and give what they say."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_python_snippets_run(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    section = section[: section.index("\n## ", 1)]  # the server's client snippet needs a server: its own test
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2
    check = ("\nassert len(res.texts) == 2 and all(res.texts) and res.finish_reasons[0] in ('length', 'stop')"
             "\nassert logits.shape == (1, engine.vocab_size)"
             "\nassert req.finish_reason in ('stop', 'length') and req.token_ids and req.timings.ttft_s > 0"
             "\nprint('snippets ok')\n")
    script = tmp_path / "snippet.py"
    script.write_text("\n".join(blocks) + check)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.rstrip().endswith("snippets ok")
