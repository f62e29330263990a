"""ringcore.torch: placeholder."""
