"""Compare the SASS of the kernels in one CUDA source between two revisions (a development tool, no GPU needed).

A refactor that leaves a kernel's instruction stream unchanged cannot change its speed or its results, so a kernel
whose SASS matches a revision that was measured and GPU-tested needs neither again. This builds `source` (relative
to the repository root) with nvcc to a cubin at each revision (git archive of cpp/ and the file), disassembles it
with cuobjdump, and prints, per kernel whose name contains `--match`, the instruction count and a hash of its
instructions at both revisions. Addresses and branch / BSSY / CALL targets are masked, so a kernel that only moved
in the file still matches. Template arguments added on one side make kernel names differ; --rename maps a name
fragment of the new side to the old one (e.g. "ELb0E=E") before the names are paired.

Usage: python tools/dev/kernel_check/sass_diff.py SOURCE OLD_REV [NEW_REV|WORKTREE] [--match TEXT] [--rename A=B ...]
                                              [--arch sm_90a] [--include DIR ...]
Needs nvcc and cuobjdump on PATH (cuobjdump: the nvidia-cuda-cuobjdump wheel if the toolkit lacks it). Exit status
1 when a paired kernel differs or a kernel has no partner.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+([^;]*;)")
_TARGET = re.compile(r"0x[0-9a-f]+")


def tree(rev: str, dest: str, repo: str) -> str:
    """The repository's cpp/ and tools/ at `rev` under dest ("WORKTREE": the working tree itself)."""
    if rev == "WORKTREE":
        return repo
    archive = subprocess.run(["git", "-C", repo, "archive", rev, "cpp", "tools"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return dest


def kernels(root: str, source: str, arch: str, includes: list[str]) -> dict[str, list[str]]:
    """{kernel name: instructions with addresses and branch targets masked} of `source` built under root."""
    cubin = os.path.join(root, "_sass_diff.cubin")
    cmd = ["nvcc", "-std=c++17", "-O3", f"-arch={arch}", "--expt-relaxed-constexpr", "-ftz=false", "-cubin",
           "-I" + os.path.join(root, "cpp"), *(a for d in includes for a in ("-isystem", d)), "-o", cubin,
           os.path.join(root, source)]
    subprocess.run(cmd, check=True)
    sass = subprocess.run(["cuobjdump", "-sass", cubin], check=True, capture_output=True, text=True).stdout
    os.remove(cubin)
    out = {}
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        insns = []
        for ins in _INSN.findall(chunk):
            if any(op in ins for op in ("BRA", "BSSY", "CALL", "BREAK", "WARPSYNC")):
                ins = _TARGET.sub("X", ins)
            insns.append(ins)
        out[name] = insns
    return out


def digest(insns: list[str]) -> str:
    return hashlib.md5("\n".join(insns).encode()).hexdigest()[:10]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default="WORKTREE")
    ap.add_argument("--match", default="")
    ap.add_argument("--rename", nargs="*", default=[], help="NEW=OLD name fragments")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--include", nargs="*", default=[], help="extra -isystem directories (e.g. jaxlib's include)")
    args = ap.parse_args()
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True,
                          text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as d_old, tempfile.TemporaryDirectory() as d_new:
        old = kernels(tree(args.old, d_old, repo), args.source, args.arch, args.include)
        new = kernels(tree(args.new, d_new, repo), args.source, args.arch, args.include)
    renames = [r.split("=", 1) for r in args.rename]

    def paired(name: str) -> str:
        for a, b in renames:
            name = name.replace(a, b)
        return name

    bad = 0
    for name in sorted(n for n in new if args.match in n):
        ref = old.get(paired(name))
        ins = new[name]
        if ref is None:
            print(f"NEW   {len(ins):6d} {digest(ins)}  {name}")
            bad += 1
            continue
        same = ref == ins
        bad += not same
        print(f"{'same' if same else 'DIFF':5} {len(ref):6d} {digest(ref)} -> {len(ins):6d} {digest(ins)}  {name}")
    print(f"{bad} kernel(s) differ or are new")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
