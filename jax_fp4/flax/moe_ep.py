"""Flax NNX expert-parallel mixture-of-experts MLP: `jax_fp4.flax.moe.MoEMLP` with its experts split over a mesh axis.

`ExpertParallelMoEMLP(..., mesh=mesh, expert_axis="expert", batch_axes=("data", "expert"))` has MoEMLP's parameters
(same paths, shapes and initial values for the same rngs, so checkpoints move between the two), with the expert
kernels ``up.kernel`` [E, D, H'] and ``down.kernel`` [E, H, D_out] annotated P(expert_axis, None, None): each device
of the expert axis holds E / n experts. The norm and the router run as in MoEMLP, on the tokens as XLA shards them
(the router replicated); the expert computation runs in `jax.shard_map` over the mesh, each device with its T / m
tokens (m: the product of the batch axes' sizes) and its experts, the tokens moving to their experts' devices and
back through `jax.lax.all_to_all` over the expert axis (`jax_fp4.expert_parallel`: fixed-capacity buffers,
dropless by default, ``capacity_factor`` to bound them; docs/design.md "Expert parallelism").
"""

from __future__ import annotations

import math
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax.sharding import PartitionSpec as P

from jax_fp4 import expert_dispatch as ed
from jax_fp4 import expert_parallel as ep
from jax_fp4.flax.moe import MoEMLP, default_expert_init
from jax_fp4.flax.nnx_layers import RngsLike, quantize_key

__all__ = ["ExpertParallelMoEMLP"]


class ExpertParallelMoEMLP(MoEMLP):
    """`MoEMLP` with expert parallelism over ``expert_axis`` of ``mesh`` (module docstring).

    Args (besides MoEMLP's, which keep their meaning):
      mesh: the `jax.sharding.Mesh` the layer runs on (its axis types Auto).
      expert_axis: the mesh axis the experts are split over (size n; E must be a multiple of n).
      batch_axes: the mesh axes the tokens are split over, in order (default (expert_axis,)); must contain
        expert_axis. The tokens x [..., D] are flattened to [T, D] and split over these axes (T a multiple of
        their product m).
      capacity_factor: None (default: dropless, the dispatch buffers sized for the worst case, T/m * k rows per
        source and destination) or cf > 0 (ceil(cf * T/m * k / n) rows, assignments past them dropped:
        `jax_fp4.expert_parallel.capacity`).
      quantized_dispatch: None (default: quantized when the recipe at call time quantizes the fprop x and the dgrad
        dy operands, e.g. mxfp8, nvfp4, nvfp4-fwd-mxfp8-bwd; not for bf16), True (ValueError where the recipe
        cannot) or False:
        dispatch the tokens (forward) and the down GEMM's dy (backward) as their quantized GEMM operands
        (`jax_fp4.expert_dispatch`), else in the compute dtype. The combine and dx always move the compute dtype.

    Call: as MoEMLP (``layer(x, *, rngs=None, return_aux_loss=False)``); with ``return_load=True`` it also
    returns the float32 [E] fraction of the T * k assignments routed to each expert (the load; sums to 1).

    Raises:
      ValueError (construction): expert_axis not a mesh axis or not in batch_axes; E not a multiple of its size.
      ValueError (trace time): T not a multiple of the batch axes' product.
    """

    def __init__(self, in_features: int, hidden_features: int, num_experts: int, out_features: int | None = None,
                 *, mesh, expert_axis: str = "expert", batch_axes: tuple[str, ...] | None = None,
                 capacity_factor: float | None = None, quantized_dispatch: bool | None = None,
                 kernel_init: tp.Callable = default_expert_init, **kwargs):
        batch_axes = (expert_axis,) if batch_axes is None else tuple(batch_axes)
        where = "ExpertParallelMoEMLP"
        if expert_axis not in mesh.shape:
            raise ValueError(f"{where}: expert_axis {expert_axis!r} is not an axis of the mesh {dict(mesh.shape)}")
        if expert_axis not in batch_axes or any(a not in mesh.shape for a in batch_axes):
            raise ValueError(f"{where}: batch_axes {batch_axes} must be mesh axes ({tuple(mesh.shape)}) and include "
                             f"expert_axis {expert_axis!r} (each device of the expert axis sends its own tokens)")
        n = mesh.shape[expert_axis]
        if num_experts % n:
            raise ValueError(f"{where}: num_experts {num_experts} is not a multiple of the {expert_axis!r} axis size "
                             f"{n}: every device must hold the same number of experts")
        ep.capacity(1, 1, n, capacity_factor)  # checks capacity_factor
        init = nnx.with_partitioning(kernel_init, (expert_axis, None, None), mesh=mesh)
        super().__init__(in_features, hidden_features, num_experts, out_features, kernel_init=init, **kwargs)
        self.mesh, self.expert_axis, self.batch_axes = mesh, expert_axis, batch_axes
        self.capacity_factor = capacity_factor
        self.quantized_dispatch = None if quantized_dispatch is None else bool(quantized_dispatch)
        self.dispatches_quantized()  # checks the option against the recipe

    def dispatches_quantized(self) -> bool:
        """Whether a call dispatches quantized operands with the layer's current recipe (a policy may replace it):
        ``quantized_dispatch`` if set, else whether the recipe can (`jax_fp4.expert_dispatch.quantized_dispatch`).

        Raises:
          ValueError: quantized_dispatch=True with a recipe that cannot.
        """
        able = ed.quantized_dispatch(self.recipe)
        if self.quantized_dispatch and not able:
            raise ValueError(f"ExpertParallelMoEMLP: quantized_dispatch=True needs a recipe that quantizes the fprop x "
                             f"and the dgrad dy operands without the RHT; {self.recipe.name} does not (leave "
                             "quantized_dispatch None)")
        return able if self.quantized_dispatch is None else self.quantized_dispatch

    def __call__(self, x: jax.Array, *, rngs: RngsLike = None, return_aux_loss: bool = False,
                 return_load: bool = False):
        lead, d = x.shape[:-1], x.shape[-1]
        h = self.norm(x) if self.norm is not None else x
        x2 = h.reshape(math.prod(lead), d)
        t = x2.shape[0]
        m = math.prod(self.mesh.shape[a] for a in self.batch_axes)
        if t % m:
            raise ValueError(f"ExpertParallelMoEMLP: {t} tokens (x {x.dtype}{list(x.shape)}) do not split over the "
                             f"batch axes {self.batch_axes} ({m} devices): make the token count a multiple of {m}")
        probs, weights, experts = self.route(x2)
        up, down = self.up.kernel[...], self.down.kernel[...]
        x2, up, down = dtypes.promote_dtype((x2, up, down), dtype=self.dtype)
        key = quantize_key(self, rngs, (x2, up, down))
        n = self.mesh.shape[self.expert_axis]
        cap = ep.capacity(t // m, self.top_k, n, self.capacity_factor)
        others = tuple(a for a in self.batch_axes if a != self.expert_axis)
        quantized = self.dispatches_quantized()

        def body(x2, w, e, up, down, key):
            # The experts are replicated over the other batch axes: varying there, their gradients are summed over
            # those axes by the transpose (a psum in the compute dtype).
            up, down = ep.varying(up, others), ep.varying(down, others)
            return ep.expert_mlp(x2, w, e, up, down, recipe=self.recipe, num_experts=self.num_experts,
                                 axis_name=self.expert_axis, cap=cap, alignment=self.alignment,
                                 activation=self.activation, key=key, quantized=quantized,
                                 implementation=self.implementation)

        tok, exp = P(self.batch_axes, None), P(self.expert_axis, None, None)
        keys = P() if key is not None else None
        # tokamax's Pallas kernels (Triton, Mosaic GPU) declare outputs that vary over no mesh axis, which a
        # shard_map that checks varying axes refuses; unchecked, shard_map's transpose itself sums the gradient of
        # an input replicated over the other batch axes (the experts) over those axes, so the result is the same.
        y = jax.shard_map(body, mesh=self.mesh, in_specs=(tok, tok, tok, exp, exp, keys), out_specs=tok,
                          check_vma=self.implementation != "tokamax")(x2, weights, experts, up, down, key)
        y = y.reshape(*lead, self.out_features)
        if not (return_aux_loss or return_load):
            return y
        frac = jnp.bincount(experts.reshape(-1), length=self.num_experts) / (t * self.top_k)
        out = (y,)
        if return_aux_loss:
            out += (self.num_experts * jnp.sum(frac * jnp.mean(probs, axis=0)),)
        if return_load:
            out += (frac.astype(jnp.float32),)
        return out
