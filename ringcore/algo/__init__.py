"""Collective algorithms as schedules: pure data, run by :mod:`ringcore.algo.execute`."""
