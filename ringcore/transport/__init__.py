"""Transports: how segments move between ranks (in-process loopback, TCP)."""
