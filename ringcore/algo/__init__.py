"""Collective algorithms as schedules (pure data), compiled for a transport and run by the executors.

Schedules: :mod:`~ringcore.algo.steps` (what a step is), :mod:`~ringcore.algo.ring`
(scatter-reduce, allgather), :mod:`~ringcore.algo.recursive_doubling`,
:mod:`~ringcore.algo.halving_doubling`, :mod:`~ringcore.algo.broadcast` (chain
broadcast, dissemination barrier). :mod:`~ringcore.algo.program` compiles a
schedule for a transport into the one form every executor runs. Executors:
:mod:`~ringcore.algo.execute` (pipelined), :mod:`~ringcore.algo.lockstep`
(one step at a time, for one-segment schedules) and the staged GPU one in
:mod:`ringcore.device.staging`, all waiting through :mod:`~ringcore.algo.waiting`. Without frames of data:
:mod:`~ringcore.algo.direct`, the allreduce on symmetric memory.
"""
