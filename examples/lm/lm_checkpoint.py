"""Orbax checkpoints of a train_lm run: the nnx state (typed PRNG keys, e.g. the stochastic-rounding streams, stored
as raw key data and re-wrapped on restore) and a JSON metadata record, in a CheckpointManager keeping the last two."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp


def is_key(x):
    """Whether array x holds typed PRNG keys."""
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def saveable(state):
    """The nnx state as a pure dict of arrays (typed PRNG keys, e.g. the stochastic-rounding streams, as raw data)."""
    from flax import nnx

    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, nnx.to_pure_dict(state))


def checkpointer(directory: Path):
    """An Orbax CheckpointManager over directory keeping the last two checkpoints."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2))


def latest_step(directory: Path):
    """The step of the latest checkpoint in directory, or None."""
    if not directory.is_dir():
        return None
    mgr = checkpointer(directory)
    try:
        return mgr.latest_step()
    finally:
        mgr.close()


def save_checkpoint(mgr, step: int, state, meta: dict):
    """Saves state (as `saveable`) and the JSON-serialisable meta at step (replacing a checkpoint there)."""
    import orbax.checkpoint as ocp

    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(saveable(state)), meta=ocp.args.JsonSave(meta)),
             force=True)


def restore_meta(mgr, step: int) -> dict:
    """The metadata of the checkpoint at step (without its state)."""
    import orbax.checkpoint as ocp

    return mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


def restore_checkpoint(mgr, step: int, state):
    """(state, meta) of the checkpoint at step; `state` (a fresh model's) gives the structure, dtypes and key impls."""
    import orbax.checkpoint as ocp
    from flax import nnx

    template = nnx.to_pure_dict(state)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, saveable(state))
    r = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                  meta=ocp.args.JsonRestore()))
    pure = jax.tree.map(lambda t, v: jax.random.wrap_key_data(v, impl=jax.random.key_impl(t)) if is_key(t) else v,
                        template, r.state)
    nnx.replace_by_pure_dict(state, pure)
    return state, r.meta
