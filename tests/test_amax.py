"""Tensor amax (`jf4_amax`): the primitive against numpy and the reference, bit-exact.

Every test runs on the CPU (the reference lowering) and, marked `gpu`, on the CUDA kernel. The GPU variant checks
that the jitted HLO holds the `jf4_amax` custom call, so it cannot silently run the reference.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_fp4._src import ffi
from jax_fp4._src.primitives.amax import tensor_amax
from jax_fp4.reference.amax import amax as reference_amax

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
CUSTOM_CALL = re.compile(r"custom_call\s*@jf4_amax\b")


class Impl:
    """Where the primitive runs: 'cpu' (reference lowering) or 'gpu' (CUDA FFI kernel)."""

    def __init__(self, platform: str):
        self.platform = platform
        self.device = jax.devices(platform)[0]

    def put(self, x):
        return jax.device_put(x, self.device)

    def check_lowering(self, fn, *args):
        """Assert the jitted `fn` lowers to the FFI custom call on GPU, and on CPU to the host handler when the CPU
        extension is built, else to the reference."""
        text = jax.jit(fn).lower(*args).as_text()
        if self.platform == "gpu":
            assert ffi.HAS_CUDA_KERNELS, f"GPU test without the CUDA extension: {ffi.import_error()}"
            assert CUSTOM_CALL.search(text), f"no jf4_amax custom call in the GPU HLO:\n{text}"
        elif ffi.HAS_CPU_KERNELS:
            assert CUSTOM_CALL.search(text), f"no jf4_amax custom call in the CPU HLO:\n{text}"
        else:
            assert not CUSTOM_CALL.search(text), text

    def amax(self, x, *, jit=True):
        x = self.put(x)
        if jit:
            self.check_lowering(tensor_amax, x)
            out = jax.jit(tensor_amax)(x)
        else:
            out = tensor_amax(x)
        out = jax.block_until_ready(out)
        assert out.shape == () and out.dtype == jnp.float32
        if self.platform == "gpu":
            assert out.devices() == {self.device}
        return np.asarray(out)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def impl(request) -> Impl:
    return Impl(request.param)


def expected_amax(x) -> np.float32:
    """numpy oracle: max |x| over the non-NaN elements, in float64, cast to float32 (0 when none)."""
    xf = np.asarray(x).astype(np.float64).ravel()
    xf = np.abs(xf[~np.isnan(xf)])
    return np.float32(xf.max()) if xf.size else np.float32(0.0)


def bits(v) -> np.ndarray:
    return np.asarray(v, np.float32).view(np.uint32)


def assert_bits_equal(got, want, what=""):
    got_b, want_b = bits(got), bits(want)
    assert np.array_equal(got_b, want_b), (
        f"{what}: got {np.asarray(got)!r} (0x{got_b.ravel()[0]:08x}), want {np.asarray(want)!r} "
        f"(0x{want_b.ravel()[0]:08x})"
        if got_b.size == 1
        else f"{what}: first mismatch at {np.argwhere(got_b != want_b)[0]}: got {got} want {want}"
    )


def random_array(rng, shape, dtype, *, spread=8):
    """Values with random signs and exponents spread over +-2**spread (exactly representable in `dtype`)."""
    mant = rng.uniform(1.0, 2.0, size=shape)
    exp = rng.integers(-spread, spread + 1, size=shape)
    sign = rng.choice([-1.0, 1.0], size=shape)
    return np.asarray(sign * mant * np.exp2(exp)).astype(dtype)


SHAPES = [(), (1,), (0,), (0, 5), (7,), (3, 1000), (33, 17), (4, 5, 6), (2, 3, 129), (1000003,)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random(impl, rng, dtype, shape):
    x = random_array(rng, shape, dtype)
    out = impl.amax(x)
    want = expected_amax(x)
    assert_bits_equal(out, want, f"{jnp.dtype(dtype).name}{list(shape)}")
    assert_bits_equal(out, reference_amax(x), "vs reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_eager_matches_jit(impl, rng, dtype):
    x = random_array(rng, (129, 31), dtype)
    assert_bits_equal(impl.amax(x, jit=False), impl.amax(x), "eager vs jit")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 15, 16, 17, 63, 1025, 4099])
def test_max_at_every_region(impl, rng, dtype, n):
    """The maximum sits in the head, the vector body or the tail of the kernel's split."""
    base = random_array(rng, (n,), dtype, spread=2)
    for pos in sorted({0, 1, n // 2, n - 2, n - 1} & set(range(n))):
        x = base.copy()
        x[pos] = np.asarray(-1000.0 if pos % 2 else 1000.0, dtype)
        assert_bits_equal(impl.amax(x), np.float32(1000.0), f"n={n} pos={pos}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("offset", [1, 2, 3, 5, 7])
def test_sliced_input(impl, rng, dtype, offset):
    """A slice at an element offset (possibly a misaligned buffer for the kernel)."""
    x = random_array(rng, (1000 + offset,), dtype, spread=2)
    x[offset] = np.asarray(-777.0, dtype)
    x[-1] = np.asarray(600.0, dtype)
    xd = impl.put(x)
    fn = jax.jit(lambda a: tensor_amax(a[offset:]))
    out = np.asarray(fn(xd))
    assert_bits_equal(out, expected_amax(x[offset:]), f"offset={offset}")


def _special(dtype, values):
    return np.asarray(values, np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_nan_ignored(impl, dtype):
    x = _special(dtype, [1.0, np.nan, -3.0, 2.0, -np.nan, 0.5])
    assert_bits_equal(impl.amax(x), np.float32(3.0), "NaN present")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("inf", [np.inf, -np.inf])
def test_inf(impl, dtype, inf):
    x = _special(dtype, [1.0, np.nan, inf, 2.0] * 50)
    assert_bits_equal(impl.amax(x), np.float32(np.inf), "inf present")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1,), (13,), (1000,)], ids=str)
def test_all_nan(impl, dtype, shape):
    x = np.full(shape, np.nan, np.float32).astype(dtype)
    x[::2] = -x[::2]
    assert_bits_equal(impl.amax(x), np.float32(0.0), "all NaN")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_all_zero_and_negative_zero(impl, dtype):
    x = _special(dtype, [-0.0, 0.0, -0.0] * 11)
    assert_bits_equal(impl.amax(x), np.float32(0.0), "zeros")


def test_f32_subnormal_kept(impl):
    x = np.array([1e-40], np.float32)
    out = impl.amax(x)
    assert bits(out) == bits(np.float32(1e-40)) and out != 0
    x = np.array([-1e-45, 3e-44, -2e-44, 0.0], np.float32)
    assert_bits_equal(impl.amax(x), np.float32(3e-44), "f32 subnormals")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_16bit_subnormal_kept(impl, dtype):
    tiny = np.asarray(ml_dtypes.finfo(dtype).smallest_subnormal, dtype)
    x = np.array([0.0, -3 * float(tiny), float(tiny)], np.float64).astype(dtype)
    out = impl.amax(x)
    assert_bits_equal(out, expected_amax(x), "16-bit subnormals")
    assert out != 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_largest_finite(impl, dtype):
    big = float(ml_dtypes.finfo(dtype).max)
    x = np.array([1.0, -big, np.nan], np.float64).astype(dtype)
    assert_bits_equal(impl.amax(x), np.float32(big), "max finite")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_vmap(impl, rng, dtype, axis):
    x = random_array(rng, (3, 4, 5), dtype)
    x[1, 2, 3] = np.nan
    out = np.asarray(jax.jit(jax.vmap(tensor_amax, in_axes=axis))(impl.put(x)))
    want = np.stack([expected_amax(np.take(x, i, axis=axis)) for i in range(x.shape[axis])])
    assert out.shape == (x.shape[axis],) and out.dtype == np.float32
    assert np.array_equal(bits(out), bits(want)), (out, want)


def test_vmap_nested(impl, rng):
    x = random_array(rng, (2, 3, 7), jnp.bfloat16)
    out = np.asarray(jax.vmap(jax.vmap(tensor_amax, in_axes=1), in_axes=0)(impl.put(x)))
    want = np.array([[expected_amax(x[i, :, j]) for j in range(7)] for i in range(2)], np.float32)
    assert np.array_equal(bits(out), bits(want))


def test_grad_is_stop_gradient(impl, rng):
    x = impl.put(random_array(rng, (17,), jnp.float32))
    g = jax.jit(jax.grad(lambda a: tensor_amax(a) * jnp.sum(a)))(x)
    a = expected_amax(np.asarray(x))
    np.testing.assert_array_equal(np.asarray(g), np.full((17,), a, np.float32))
    _, t = jax.jvp(tensor_amax, (x,), (jnp.ones_like(x),))
    assert float(t) == 0.0


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_], ids=lambda d: jnp.dtype(d).name)
def test_bad_dtype(dtype):
    x = jnp.zeros((2, 3), dtype)
    name = jnp.dtype(dtype).name
    with pytest.raises(ValueError, match=name):
        tensor_amax(x)
    with pytest.raises(ValueError, match=re.escape(f"{name}[2, 3]")):
        jax.jit(tensor_amax)(x)
    with pytest.raises(ValueError, match=name):
        jax.vmap(tensor_amax)(x)


def test_abstract_eval_shapes():
    for shape in [(), (0,), (5, 0, 3), (4, 7)]:
        out = jax.eval_shape(tensor_amax, jax.ShapeDtypeStruct(shape, jnp.bfloat16))
        assert out.shape == () and out.dtype == jnp.float32


def test_ffi_module_consistent():
    """HAS_CUDA_KERNELS agrees with the extension, and the CUDA lowering follows it (checked on any host)."""
    assert isinstance(ffi.HAS_CUDA_KERNELS, bool)
    assert ffi.HAS_CUDA_KERNELS == (ffi.extension() is not None)
    assert ffi.HAS_CUDA_KERNELS == (ffi.import_error() is None)
    assert ffi.ensure_registered() == ffi.HAS_CUDA_KERNELS
    assert ffi.ensure_registered() == ffi.HAS_CUDA_KERNELS  # idempotent
    x = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
    text = jax.jit(tensor_amax).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    if ffi.HAS_CUDA_KERNELS:
        assert "jf4_amax" in ffi.targets()
        assert set(ffi.extension().registrations()) == set(ffi.targets())
        assert CUSTOM_CALL.search(text), text
    else:
        assert ffi.targets() == ()
        assert not CUSTOM_CALL.search(text), text


def test_missing_extension_warns_once(tmp_path):
    """Without the extensions the package still works and warns exactly once (ReferenceOnlyWarning)."""
    import jax_fp4

    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(jax_fp4.__file__)))
    code = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["jax_fp4._jax_fp4_cuda"] = None  # makes `import jax_fp4._jax_fp4_cuda` raise ImportError
        sys.modules["jax_fp4._jax_fp4_cpu"] = None  # (a CPU-only install with its CPU kernels imports silently)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import jax_fp4._src.ffi as ffi
            import jax_fp4._src.primitives.amax as amax
            import jax_fp4._src.ffi  # cached: no second warning
        ws = [x for x in w if issubclass(x.category, ffi.ReferenceOnlyWarning)]
        assert len(ws) == 1, [str(x.message) for x in w]
        assert "reference" in str(ws[0].message)
        assert not ffi.HAS_CUDA_KERNELS and not ffi.ensure_registered()
        import jax, jax.numpy as jnp
        x = jnp.array([1.0, -5.0, float("nan")], jnp.bfloat16)
        assert float(amax.tensor_amax(x)) == 5.0
        text = jax.jit(amax.tensor_amax).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert "custom_call" not in text
        print("OK")
        """
    )
    env = dict(os.environ, PYTHONPATH=pkg_parent + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    with warnings.catch_warnings():
        res = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr
