"""ringcore.jax (being written)."""
