"""jax_fp4 internals (not public API)."""
