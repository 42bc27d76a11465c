"""CUDA kernels vs the golden reference bits of make.py (run on the GPU machine; see README.md)."""

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import cases, expected_kernels, fn, leaves, make_x  # noqa: E402


def main():
    ref = np.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref.npz"))
    ok = bad = 0
    for i, c in enumerate(cases()):
        if f"{i}_n" not in ref:
            continue
        x = make_x(c[2], c[1], i, c[3])
        f = fn(c)
        try:
            hlo = jax.jit(f).lower(x, jax.random.key(i)).as_text()
            out = leaves(jax.jit(f)(x, jax.random.key(i)))
        except Exception as e:  # report and go on
            print("ERR", i, c, repr(e)[:300])
            bad += 1
            continue
        errs = []
        for j in range(int(ref[f"{i}_n"])):
            r, g = ref[f"{i}_{j}"], out[j]
            if r.shape != g.shape or not np.array_equal(r, g):
                idx = np.flatnonzero(r != g)[:4] if r.shape == g.shape else None
                errs.append((j, r.shape, g.shape, idx, None if idx is None else (r[idx], g[idx])))
        if errs:
            bad += 1
            print("BAD", i, c, "kernel" if "jf4_" in hlo else "NOKERNEL", errs[:3], flush=True)
        else:
            ok += 1
            missing = [k for k in expected_kernels(c) if k not in hlo]
            if missing:
                print("OK-but-no-kernel", i, c, missing)
    print(f"ok {ok} bad {bad}")


if __name__ == "__main__":
    main()
