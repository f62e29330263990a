"""Framework adapters (PyTorch, JAX): they convert, never reimplement."""
