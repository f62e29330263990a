"""Transports: how segments move between ranks.

:mod:`~ringcore.transport.base` (the contract every transport keeps),
:mod:`~ringcore.transport.wire` (frame headers and tags),
:mod:`~ringcore.transport.loopback` (in-process, for tests and one-process worlds),
:mod:`~ringcore.transport.tcp` with :mod:`~ringcore.transport.tcp_connection` (TCP),
:mod:`~ringcore.transport.mesh` (connecting every pair of ranks),
:mod:`~ringcore.transport.rdma` (the RDMA protocol), :mod:`~ringcore.transport.ibverbs`
(its pyverbs glue) and :mod:`~ringcore.transport.registration` (the memory-registration cache).
"""
