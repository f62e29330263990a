"""Placeholder, replaced by the torch.distributed backend "ringcore" (being written)."""


def register() -> None:
    """Register the backend with torch.distributed (placeholder)."""
