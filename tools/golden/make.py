"""Reference bits of every case in cases.py -> tools/golden/ref.npz (run on CPU; see README.md)."""

import os
import sys

import jax
import numpy as np

from jax_fp4._src.ffi import reference_lowering_on_cpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import cases, fn, leaves, make_x  # noqa: E402


def main():
    with reference_lowering_on_cpu():  # the reference's bits, not the CPU extension's
        res = _reference_bits()
    np.savez_compressed(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref.npz"), **res)
    print("cases", len(cases()))


def _reference_bits():
    res = {}
    for i, c in enumerate(cases()):
        x = make_x(c[2], c[1], i, c[3])
        try:
            out = leaves(jax.jit(fn(c))(x, jax.random.key(i)))
        except ValueError as e:
            print("reject", i, c, e)
            continue
        for j, bits in enumerate(out):
            res[f"{i}_{j}"] = bits
        res[f"{i}_n"] = np.array(len(out))
    return res


if __name__ == "__main__":
    main()
