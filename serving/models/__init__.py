"""Model code: pure JAX forward functions over a params pytree."""
