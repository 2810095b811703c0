"""Instruction mix of a kernel's hot loop, from its SASS, on a machine without a GPU: what the NVFP4 gemv's
instruction-count work was measured with (bench/RESULTS.md#session-12).

Needs nvcc and cuobjdump (the CPU machine has nvcc; cuobjdump comes from the wheel `nvidia-cuda-cuobjdump`:
`pip download --no-deps nvidia-cuda-cuobjdump` and unzip it, then pass --cuobjdump or put its bin/ on PATH).

  python scripts/sass_hot_loop.py dsv4_ops/csrc/cuda/nvfp4_gemv.cu gemv_kernelILi1ELi2ELi3 --per HMMA:8

The hot loop is the shortest backward branch whose body holds at least --min of the --per opcode and no block
barrier; counts are printed per unit of --per (e.g. HMMA:8 = per 1 KB weight chunk of the gemv).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")


def sass(cubin: str, name: str, cuobjdump: str) -> list[tuple[int, str]]:
    funcs = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    names = [ln.split()[-1] for ln in funcs.splitlines() if "Function :" in ln and name in ln]
    if not names:
        sys.exit(f"no function matching {name!r} in {cubin}")
    out = subprocess.run([cuobjdump, "-sass", "-fun", names[0], cubin], capture_output=True, text=True,
                         check=True).stdout
    return [(int(m.group(1), 16), m.group(2).strip()) for m in LINE.finditer(out)]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def hot_loop(ins: list[tuple[int, str]], unit: str, least: int) -> list[tuple[int, str]] | None:
    best = None
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [x for x in ins if int(m.group(1), 16) <= x[0] <= addr]
        if sum(opcode(t) == unit for _, t in body) >= least and not any("BAR.SYNC" in t for _, t in body):
            if best is None or len(body) < len(best):
                best = body
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", help=".cu file (compiled for sm_90a) or a .cubin")
    ap.add_argument("function", help="substring of the mangled kernel name")
    ap.add_argument("--per", default="HMMA:8", help="OPCODE:N, counts are per N of OPCODE (default HMMA:8)")
    ap.add_argument("--min", type=int, default=24, help="the loop holds at least this many of OPCODE")
    ap.add_argument("--cuobjdump", default="cuobjdump")
    args = ap.parse_args()
    unit, n = args.per.split(":")
    cubin = args.source
    if not cubin.endswith(".cubin"):
        cubin = os.path.join(tempfile.mkdtemp(), "k.cubin")
        here = os.path.dirname(os.path.abspath(args.source))
        subprocess.run(["nvcc", "-arch=sm_90a", "-O3", "-std=c++17", "-cubin", "-o", cubin, f"-I{here}",
                        f"-I{os.path.dirname(here)}", args.source], check=True)
    body = hot_loop(sass(cubin, args.function, args.cuobjdump), unit, args.min)
    if body is None:
        sys.exit(f"no loop with >= {args.min} {unit}")
    units = sum(opcode(t) == unit for _, t in body) / int(n)
    mix = collections.Counter(opcode(t) for _, t in body)
    print(f"loop {body[0][0]:#x}-{body[-1][0]:#x}: {len(body)} instructions, {len(body) / units:.1f} per {args.per}")
    print("  ".join(f"{k} {v / units:.1f}" for k, v in mix.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
