"""JAX primitives of jax_fp4: one module per op family (abstract eval, lowerings, batching, AD rules)."""
