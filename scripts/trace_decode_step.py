"""Follow one decode step through the code: which files of the model a layer's decode enters, and how often.

Builds the built-in default model on the CPU, prefills a short prompt, then runs one eager decode step with
layer 1's `Block.decode` (a CSA layer: compressor, indexer, MoE) traced by sys.setprofile. A "file" is a source
file of dsv4_model/ or dsv4_ops/ (torch's own code is not counted: calls through it are seen from the repo frame
below them). It prints
- files: the distinct files entered;
- switches: how often the file changed from one call of a repo function to the next;
- returns: those switches into a file entered before (what makes a reader jump back and forth): switches -
  (files - 1);
- the same two counted with the returns into the calling file as well (every change of the innermost repo frame's
  file).
--list prints every call of a repo function (indented by repo depth) and every return into another file.

  python scripts/trace_decode_step.py                 # float weights (quant="none"), bf16
  python scripts/trace_decode_step.py --quant nvfp4   # NVFP4 weights (what the shipped model loads as)
  python scripts/trace_decode_step.py --list          # the path itself
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

COUNTED = tuple(os.path.join(ROOT, pkg) + os.sep for pkg in ("dsv4_model", "dsv4_ops"))


def _counted(frame) -> bool:
    return frame.f_code.co_filename.startswith(COUNTED)


def _repo_frame(frame):
    """The innermost frame of a counted file at or above `frame`, or None."""
    while frame is not None and not _counted(frame):
        frame = frame.f_back
    return frame


def _file(frame) -> str:
    return os.path.relpath(frame.f_code.co_filename, ROOT)


class StepTrace:
    """sys.setprofile hook: every call of a repo function and every return into another repo file, in order, as
    (kind "call" | "back", file, function, repo depth)."""

    def __init__(self):
        self.events: list[tuple[str, str, str, int]] = []

    def __call__(self, frame, event, arg) -> None:
        if event == "call" and _counted(frame):
            depth, f = 0, frame.f_back
            while f is not None:
                depth += _counted(f)
                f = f.f_back
            self.events.append(("call", _file(frame), frame.f_code.co_qualname, depth))
        elif event == "return" and _counted(frame):
            back = _repo_frame(frame.f_back)
            if back is not None and back.f_code.co_filename != frame.f_code.co_filename:
                self.events.append(("back", _file(back), back.f_code.co_qualname, 0))


def counts(files: list[str]) -> tuple[list[str], int, int]:
    """A sequence of files -> (the distinct files in order of entry, switches, switches into a file seen before)."""
    seen, switches, returns = files[:1], 0, 0
    for a, b in zip(files, files[1:]):
        if a != b:
            switches += 1
            returns += b in seen
            seen += [] if b in seen else [b]
    return seen, switches, returns


def trace_one_step(quant: str, layer_id: int, prompt: str) -> StepTrace:
    from dsv4_model import DEFAULT_MODEL
    from dsv4_model.runtime.engine import Engine

    eng = Engine.from_pretrained(DEFAULT_MODEL, device="cpu", dtype=torch.bfloat16, max_batch_size=1,
                                 max_seq_len=256, quant=quant, progress=False, compile=False)
    ids = torch.tensor([eng.get_tokenizer().encode(prompt)])
    nxt = eng.prefill(ids).argmax(-1)
    trace = StepTrace()

    def layer_call(layer, h, tokens, step, pending, fold_rows):
        if layer.layer_id == layer_id:
            sys.setprofile(trace)
        try:
            return layer.decode(h, tokens, step, pending, fold_rows=fold_rows)
        finally:
            sys.setprofile(None)

    eng.model.decode_step(nxt, torch.tensor([ids.shape[1]]), layer_call=layer_call)
    return trace


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", choices=("none", "nvfp4"), default="none",
                   help="float weights (none, the default) or NVFP4 W4A16 (nvfp4: what the shipped model loads as)")
    p.add_argument("--layer", type=int, default=1, help="the layer whose Block.decode is traced (default 1)")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--list", action="store_true", help="print the (file, function) sequence")
    a = p.parse_args()
    torch.set_num_threads(1)
    ev = trace_one_step(a.quant, a.layer, a.prompt).events
    if a.list:
        for kind, file, func, depth in ev:
            print(f"{'  ' * depth}{file}  {func}" if kind == "call" else f"    <- {file}  {func}")
        print()
    files, switches, returns = counts([f for kind, f, _, _ in ev if kind == "call"])
    _, all_switches, all_returns = counts([f for _, f, _, _ in ev])
    print(f"quant={a.quant}, layer {a.layer}'s Block.decode: {len(files)} files / {switches} switches / {returns} "
          f"returns to a file already left (counting the returns too: {all_switches} / {all_returns})")
    for f in files:
        print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
