"""Using jax_fp4 as a drop-in in existing models (CPU, small shapes).

* inference: a forward-only call (no VJP taken) quantizes only the fprop operands, so it has no wgrad / dgrad shape
  constraint (MXFP8's M % 32 of the columnwise x, ragged group alignment) and needs no key unless the forward
  itself rounds stochastically; its output is the differentiated call's forward output, bit for bit;
* differentiation modes: reverse mode works, forward mode (jvp, jacfwd, hessian) and differentiating `quantize`
  raise TypeError saying what to use instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import recipes
from jax_fp4.formats import NVFP4

KEY = jax.random.key(7)


def _xw(m, k=64, n=32, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16),
            jax.random.normal(kw, (k, n), jnp.float32).astype(jnp.bfloat16))


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("recipe", [recipes.MXFP8(), recipes.NVFP4(), recipes.NVFP4Fwd_MXFP8Bwd()],
                         ids=lambda r: r.name)
def test_inference_has_no_backward_constraints(recipe):
    """M = 30 tokens: not a whole MXFP8 block of rows (the wgrad x's constraint), and no key although NVFP4's dy
    rounds stochastically: a forward-only call quantizes neither."""
    x, w = _xw(30)
    y = jax.jit(lambda x, w: jax_fp4.dense(x, w, recipe=recipe))(x, w)
    assert y.shape == (30, 32) and y.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y, np.float32)).all()
    # a rank-3 decode step (batch 3 x seq 10 = 30 tokens) through dot_general with two output axes
    y3 = jax_fp4.dot_general(x.reshape(3, 10, 64), w.reshape(64, 4, 8), (((2,), (0,)), ((), ())), recipe=recipe)
    np.testing.assert_array_equal(_bits(y3.reshape(30, 32)), _bits(y))


@pytest.mark.parametrize("recipe", [recipes.MXFP8(), recipes.NVFP4()], ids=lambda r: r.name)
def test_forward_only_equals_differentiated_forward(recipe):
    x, w = _xw(32, seed=1)
    got = jax.jit(lambda x, w: jax_fp4.dense(x, w, recipe=recipe, key=KEY))(x, w)
    want = jax.jit(lambda x, w: jax.vjp(lambda x, w: jax_fp4.dense(x, w, recipe=recipe, key=KEY), x, w)[0])(x, w)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_key_rules():
    x, w = _xw(32, seed=2)
    with pytest.raises(ValueError, match="gradient operand stochastically.*key"):
        jax.grad(lambda x: jax_fp4.dense(x, w, recipe=recipes.NVFP4()).astype(jnp.float32).sum())(x)
    sr_fprop = recipes.Recipe("sr-fprop", NVFP4(stochastic_rounding=True), NVFP4())
    assert sr_fprop.fprop_needs_key and not recipes.NVFP4().fprop_needs_key
    with pytest.raises(ValueError, match="fprop operand stochastically"):
        jax_fp4.dense(x, w, recipe=sr_fprop)
    assert jax_fp4.dense(x, w, recipe=sr_fprop, key=KEY).shape == (32, 32)


def test_ragged_dot_inference():
    """Forward-only ragged_dot: misaligned group sizes (40 rows) and no key, with NVFP4 (SR on dy) and MXFP8."""
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (136, 64), jnp.float32)
    w = jax.random.normal(kw, (4, 64, 32), jnp.float32)
    sizes = np.array([32, 0, 40, 64], np.int32)
    for recipe in (recipes.NVFP4(), recipes.MXFP8()):
        y = jax_fp4.ragged_dot(x, w, sizes, recipe=recipe)
        assert y.shape == (136, 32) and np.isfinite(np.asarray(y)).all()
        assert not np.asarray(y[136:]).any()
    with pytest.raises(ValueError, match="group 2"):  # concrete misaligned sizes: a trace-time error (docstring)
        jax.grad(lambda w: jax_fp4.ragged_dot(x, w, sizes, recipe=recipes.MXFP8()).sum())(w)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
def test_forward_mode_is_a_clear_error(transform):
    x, w = _xw(32, k=32, n=32, seed=4)
    x = x.astype(jnp.float32)

    def f(x):
        return jax_fp4.dense(x, w.astype(jnp.float32), recipe=recipes.MXFP8())

    run = {"jvp": lambda: jax.jvp(f, (x,), (x,)), "jacfwd": lambda: jax.jacfwd(f)(x),
           "hessian": lambda: jax.hessian(lambda x: f(x).sum())(x)}[transform]
    with pytest.raises(TypeError, match="reverse-mode"):
        run()


def test_grad_of_quantize_points_to_fake_quantize():
    x = jnp.ones((4, 32), jnp.float32)
    for fmt in (jax_fp4.NVFP4(), jax_fp4.MXFP8()):
        with pytest.raises(TypeError, match="fake_quantize"):
            jax.grad(lambda x, f=fmt: jax_fp4.dequantize(jax_fp4.quantize(x, f)).sum())(x)
    # a zero tangent never reaches the rule: quantize under grad of something else is fine
    g = jax.grad(lambda s: s * jax_fp4.dequantize(jax_fp4.quantize(x, jax_fp4.MXFP8())).sum())(2.0)
    assert g == 4 * 32


# ---- make_dot_general: any dimension numbers, one warning per unquantized form, keys per call ------------------------
flax = pytest.importorskip("flax")
from flax import linen as nn  # noqa: E402

from jax_fp4.flax import UnquantizedDotGeneralWarning, make_dot_general  # noqa: E402

MX = recipes.MXFP8()
SR_DGRAD = recipes.Recipe("sr-dgrad", dgrad_dy=NVFP4(stochastic_rounding=True), dgrad_w=NVFP4())


def _n(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def test_multi_axis_contraction_is_quantized():
    """DenseGeneral's output projection: x[B, T, H, D] . w[H, D, N] over (H, D) == dense over K = H * D."""
    x, w = _n((2, 16, 2, 32), 10), _n((2, 32, 32), 11)
    dn = (((2, 3), (0, 1)), ((), ()))
    dg = make_dot_general(MX)
    got = jax.jit(lambda x, w: dg(x, w, dn))(x, w)
    want = jax.jit(lambda x, w: jax_fp4.dense(x.reshape(2, 16, 64), w.reshape(64, 32), recipe=MX))(x, w)
    assert got.shape == (2, 16, 32)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # Linen's DenseGeneral with axis=(-2, -1) goes through the same path (no fallback, no warning)
    layer = nn.DenseGeneral(32, axis=(-2, -1), use_bias=False, dot_general=dg)
    params = {"params": {"kernel": w.astype(jnp.float32)}}
    with warnings_as_errors():
        y = jax.jit(layer.apply)(params, x)
    want32 = jax_fp4.dense(x.reshape(2, 16, 64).astype(jnp.float32), w.reshape(64, 32).astype(jnp.float32),
                           recipe=MX)
    np.testing.assert_array_equal(_bits(y), _bits(want32))


def test_transposed_and_batched_forms():
    dg = make_dot_general(MX)
    a, b = _n((64, 32), 12), _n((64, 32), 13)
    got = dg(a, b, (((0,), (0,)), ((), ())))  # contracting lhs's first axis: a.T @ b
    np.testing.assert_array_equal(_bits(got), _bits(jax_fp4.dense(a.T, b, recipe=MX)))
    q, k = _n((3, 32, 64), 14), _n((3, 32, 64), 15)
    dn = (((2,), (2,)), ((0,), (0,)))  # attention-style q . k^T per batch element
    got = dg(q, k, dn)
    assert got.shape == jax.lax.dot_general(q, k, dn).shape == (3, 32, 32)
    for i in range(3):
        np.testing.assert_array_equal(_bits(got[i]), _bits(jax_fp4.dense(q[i], k[i].T, recipe=MX)))
    with pytest.raises(ValueError, match="out of range"):
        dg(a, b, (((2,), (0,)), ((), ())))


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", UnquantizedDotGeneralWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_unquantized_form_is_reported_once():
    import warnings

    dg = make_dot_general(recipes.NVFP4_1x64())  # the registry is per process: a form no other test uses
    ints = jnp.arange(16 * 32, dtype=jnp.int32).reshape(16, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            dg(ints, ints.T, (((1,), (0,)), ((), ())))
    assert len([w for w in caught if issubclass(w.category, UnquantizedDotGeneralWarning)]) == 1


def test_keys_per_call():
    x, w, ct = _n((32, 32), 16), _n((32, 32), 17), _n((32, 32), 18)
    dn = (((1,), (0,)), ((), ()))
    dg = make_dot_general(SR_DGRAD)
    dx = jax.jit(lambda x, k: jax.vjp(lambda x: dg(x, w, dn, key=k), x)[1](ct)[0])
    a, b, c = dx(x, jax.random.key(1)), dx(x, jax.random.key(2)), dx(x, jax.random.key(1))
    assert not np.array_equal(_bits(a), _bits(b)) and np.array_equal(_bits(a), _bits(c))
    # a callable key source: a fresh key per call
    counter = iter(range(100))
    dg2 = make_dot_general(SR_DGRAD, key=lambda: jax.random.key(next(counter)))
    d1, d2 = (jax.vjp(lambda x: dg2(x, w, dn), x)[1](ct)[0] for _ in range(2))
    assert not np.array_equal(_bits(d1), _bits(d2))
    # Linen: nn.Dense draws from the "quantize" rng collection of apply
    layer = nn.Dense(32, use_bias=False, dot_general=dg)
    params = layer.init(jax.random.key(0), x.astype(jnp.float32))
    grad = jax.jit(lambda x, k: jax.grad(lambda x: jnp.sum(layer.apply(params, x, rngs={"quantize": k}) * ct))(x))
    xf = x.astype(jnp.float32)
    g1, g2, g3 = grad(xf, jax.random.key(1)), grad(xf, jax.random.key(2)), grad(xf, jax.random.key(1))
    assert not np.array_equal(_bits(g1), _bits(g2)) and np.array_equal(_bits(g1), _bits(g3))


# ---- randomness: stochastic rounding draws from its own stream ------------------------------------------------------
class _Block(flax.nnx.Module):
    def __init__(self, recipe, rngs):
        from jax_fp4.flax import nnx as fnnx

        self.fc1 = fnnx.Dense(32, 32, recipe=recipe, rngs=rngs)
        self.drop = flax.nnx.Dropout(0.5, rngs=rngs)
        self.fc2 = fnnx.Dense(32, 32, recipe=recipe, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.drop(self.fc1(x)))


@pytest.mark.parametrize("rngs", [lambda: flax.nnx.Rngs(0), lambda: flax.nnx.Rngs(params=0, dropout=1),
                                  lambda: flax.nnx.Rngs(0, quantize=5)], ids=["default", "params+dropout", "quantize"])
def test_sr_stream_leaves_weights_and_dropout_unchanged(rngs):
    """The same model built with BF16 and with a stochastic-rounding recipe: same initial weights, same dropout
    masks (the layer's SR stream is seeded without drawing from the model's other streams)."""
    nnx = flax.nnx
    a, b = _Block(recipes.BF16(), rngs()), _Block(SR_DGRAD, rngs())
    pa, pb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    for u, v in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert b.fc1.rngs is not None and b.fc2.rngs is not None
    k1, k2 = b.fc1.rngs(), b.fc2.rngs()  # the layers' streams differ from each other
    assert not np.array_equal(jax.random.key_data(k1), jax.random.key_data(k2))
    # dropout masks: ones through both models' dropout (in train mode) give the same mask
    ones = jnp.ones((4, 32), jnp.float32)
    np.testing.assert_array_equal(np.asarray(a.drop(ones)), np.asarray(b.drop(ones)))


# ---- broader sweep: every recipe, other shapes and forms ------------------------------------------------------------
ALL = [recipes.BF16(), recipes.MXFP8(), recipes.NVFP4(), recipes.NVFP4Fwd_MXFP8Bwd(), recipes.NVFP4_1x64()]


@pytest.mark.parametrize("recipe", ALL, ids=lambda r: r.name)
def test_inference_at_awkward_token_counts(recipe):
    """Forward-only at M = 1, 30 and 33 tokens (and N = 32 outputs) with every recipe: NVFP4 1x64 pads its fprop
    operands' M and N to 64 with zeros, which changes no other row: the rows equal those of a call on 64 tokens."""
    x, w = _xw(64, seed=20)
    full = jax.jit(lambda x, w: jax_fp4.dense(x, w, recipe=recipe))(x, w)
    for m in (1, 30, 33):
        y = jax.jit(lambda x, w: jax_fp4.dense(x, w, recipe=recipe))(x[:m], w)
        assert y.shape == (m, 32) and np.isfinite(np.asarray(y, np.float32)).all()
        if isinstance(recipe.fprop_x, NVFP4) and recipe.fprop_x.local_1x64 or not recipe.quantized:
            np.testing.assert_array_equal(_bits(y), _bits(full[:m]))


@pytest.mark.parametrize("form", ["leading", "batch", "rhs_trailing", "swapped"])
def test_more_dense_general_forms(form):
    """Contracting leading axes, batch axes beside two contracting axes, the kernel's trailing axes and contracting
    axes given out of order: each equals `jax_fp4.dense` of the flattened operands bit for bit, and differentiates."""
    dg = make_dot_general(MX)
    if form == "leading":  # x[H, D, T] . w[H, D, N] over (H, D): x.reshape(K, T).T @ w.reshape(K, N)
        a, b, dn = _n((2, 32, 32), 21), _n((2, 32, 32), 22), (((0, 1), (0, 1)), ((), ()))
        want = jax_fp4.dense(a.reshape(64, 32).T, b.reshape(64, 32), recipe=MX)
    elif form == "batch":
        a, b, dn = _n((2, 32, 2, 32), 21), _n((2, 2, 32, 32), 22), (((2, 3), (1, 2)), ((0,), (0,)))
        want = jnp.stack([jax_fp4.dense(a[i].reshape(32, 64), b[i].reshape(64, 32), recipe=MX) for i in range(2)])
    elif form == "rhs_trailing":  # w[N, H, D]
        a, b, dn = _n((32, 2, 32), 21), _n((32, 2, 32), 22), (((1, 2), (1, 2)), ((), ()))
        want = jax_fp4.dense(a.reshape(32, 64), b.reshape(32, 64).T, recipe=MX)
    else:  # x[T, H, D] contracted as (D, H) against w[D, H, N]: the pairs, not their order, define the product,
        # K flattens in x's axis order (H, D)
        a, b, dn = _n((32, 2, 32), 21), _n((32, 2, 32), 22), (((2, 1), (0, 1)), ((), ()))
        want = jax_fp4.dense(a.reshape(32, 64), jnp.swapaxes(b, 0, 1).reshape(64, 32), recipe=MX)
    got = jax.jit(lambda a, b: dg(a, b, dn))(a, b)
    assert got.shape == jax.lax.dot_general(a, b, dn).shape
    np.testing.assert_array_equal(_bits(got), _bits(want))
    g = jax.grad(lambda a: dg(a, b, dn).astype(jnp.float32).sum())(a)
    assert g.shape == a.shape and np.isfinite(np.asarray(g, np.float32)).all()


@pytest.mark.parametrize("recipe", ALL[1:], ids=lambda r: r.name)
def test_nonfinite_in_x_or_w_reaches_dense_and_dot_general(recipe):
    """NaN and +-inf in x or in w: the output row / column is non-finite through `dense` and the drop-in."""
    dg = make_dot_general(recipe)
    f = jax.jit(lambda x, w: (jax_fp4.dense(x, w, recipe=recipe), dg(x, w, (((1,), (0,)), ((), ())))))
    for val in (np.nan, np.inf, -np.inf):
        for where in ("x", "w"):
            x, w = (np.asarray(a, np.float32) for a in _xw(64, k=64, n=64, seed=23))
            (x if where == "x" else w)[7, 9] = val
            for y in f(x, w):
                line = np.asarray(y)[7] if where == "x" else np.asarray(y)[:, 9]
                assert not np.isfinite(line).any(), (val, where)
                if np.isnan(val):
                    assert np.isnan(line).all(), where


def test_key_must_be_a_prng_key():
    x, w = _xw(32, seed=24)
    for bad in (3, "key", jnp.ones((3,), jnp.float32)):
        with pytest.raises(TypeError, match="key must be a JAX PRNG key"):
            jax_fp4.dense(x, w, recipe=recipes.NVFP4(), key=bad)
    assert jax_fp4.dense(x, w, recipe=recipes.NVFP4(), key=jax.random.PRNGKey(0)).shape == (32, 32)


@pytest.mark.parametrize("recipe", [recipes.MXFP8(), recipes.NVFP4(), recipes.NVFP4Fwd_MXFP8Bwd()],
                         ids=lambda r: r.name)
def test_ragged_dot_other_group_sizes(recipe):
    """Forward-only ragged_dot with group sizes of 1, 2, 3 rows, a single full group and equal misaligned groups;
    rows past the groups are 0. Differentiating with concrete misaligned sizes is a ValueError naming the group."""
    x, w = _n((136, 64), 25).astype(jnp.float32), _n((4, 64, 32), 26).astype(jnp.float32)
    for sizes in ([1, 2, 3, 130], [136, 0, 0, 0], [30, 30, 30, 30]):
        s = np.array(sizes, np.int32)
        y = np.asarray(jax_fp4.ragged_dot(x, w, s, recipe=recipe))
        assert y.shape == (136, 32) and np.isfinite(y).all() and not y[sum(sizes):].any()
    with pytest.raises(ValueError, match="group 0"):
        jax.grad(lambda w: jax_fp4.ragged_dot(x, w, np.array([30, 30, 30, 30], np.int32), recipe=recipe,
                                              key=KEY).sum())(w)


@pytest.mark.parametrize("recipe", ALL[1:], ids=lambda r: r.name)
def test_forward_mode_error_for_every_recipe(recipe):
    """jvp through dense, the drop-in and ragged_dot ends in the forward-mode TypeError for every quantized recipe,
    also without a key for recipes whose backward rounds stochastically (the key is checked by the backward)."""
    x, w = (a.astype(jnp.float32) for a in _xw(64, k=64, n=64, seed=27))
    dg = make_dot_general(recipe)
    calls = [lambda x: jax_fp4.dense(x, w, recipe=recipe), lambda x: dg(x, w, (((1,), (0,)), ((), ())))]
    if not (isinstance(recipe.fprop_x, NVFP4) and recipe.fprop_x.local_1x64):  # (1x64: no grouped tensors)
        calls.append(lambda x: jax_fp4.ragged_dot(x, jnp.stack([w, w]), jnp.array([32, 32], jnp.int32),
                                                  recipe=recipe))
    for f in calls:
        with pytest.raises(TypeError, match="reverse-mode"):
            jax.jvp(f, (x,), (x,))


def test_1x64_differentiated_at_m_and_n_off_64():
    """NVFP4 1x64 training at M = 96, N = 32: the fprop operands are padded to 64 (their forward equals the padded
    call's rows and the forward-only call), the MXFP8 backward operands keep M % 32; the gradients have x's and
    w's shapes."""
    r = recipes.NVFP4_1x64()
    x, w = (a.astype(jnp.float32) for a in _xw(96, k=64, n=32, seed=28))
    y, pull = jax.vjp(lambda x, w: jax_fp4.dense(x, w, recipe=r), x, w)
    np.testing.assert_array_equal(_bits(y), _bits(jax_fp4.dense(x, w, recipe=r)))
    padded = jax_fp4.dense(jnp.pad(x, ((0, 32), (0, 0))), jnp.pad(w, ((0, 0), (0, 32))), recipe=r)[:96, :32]
    np.testing.assert_array_equal(_bits(y), _bits(padded))
    dx, dw = pull(jnp.ones_like(y))
    assert dx.shape == x.shape and dw.shape == w.shape and np.isfinite(np.asarray(dx)).all()
    with pytest.raises(ValueError, match="MXFP8.*element must be 'e4m3' or 'e5m2', got None"):
        jax_fp4.MXFP8(element=None)
