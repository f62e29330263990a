"""Placeholder, replaced by SyncBatchNorm (being written)."""
