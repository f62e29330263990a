"""Peer engines for ``bench/compare.py``: Gloo (torch.distributed) and OpenMPI (mpi4py).

Each worker measures float32 sum allreduce, in place, with the same loop and
arithmetic as ``ringcore-bench`` (:mod:`ringcore.bench.peers.loop`), and rank
0 prints one JSON line per size.
"""
