"""Gloo allreduce through torch.distributed: CPU float32, sum, in place.

Without ``--rank`` this is the launcher: it starts ``--np`` copies of itself
(ranks 0..N-1, rendezvous on a TCP store at ``--addr``:a free port) and waits;
if one rank fails it stops the others and exits with that rank's code::

    python -m ringcore.bench.peers.gloo_worker --np 4 --sizes 4K,1M --iters 20

Gloo's data connections use interface ``--ifname`` (``GLOO_SOCKET_IFNAME``,
default ``lo``): without it Gloo resolves the host name, which need not be
loopback.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time

import numpy as np

from ringcore.bench.peers import loop


class GlooPeer:
    """:class:`loop.Peer` over a torch.distributed gloo process group."""

    def __init__(self, rank: int, size: int, addr: str, port: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.torch, self.dist = torch, dist
        self.rank, self.size = rank, size
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def allreduce(self, buf: np.ndarray) -> None:
        """Sum in place; ``torch.from_numpy`` shares ``buf``'s memory."""
        self.dist.all_reduce(self.torch.from_numpy(buf), op=self.dist.ReduceOp.SUM)

    def barrier(self) -> None:
        """torch.distributed's barrier."""
        self.dist.barrier()

    def allgather(self, values: np.ndarray) -> np.ndarray:
        """Stack every rank's ``values`` as ``(size, len)``."""
        mine = self.torch.from_numpy(np.ascontiguousarray(values))
        parts = [self.torch.empty_like(mine) for _ in range(self.size)]
        self.dist.all_gather(parts, mine)
        return np.stack([p.numpy() for p in parts])

    def close(self) -> None:
        """Destroy the process group."""
        self.dist.destroy_process_group()


def free_port(addr: str) -> int:
    """A TCP port that was free on ``addr`` a moment ago."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.np`` ranks of this module; return the first failing rank's code, else 0."""
    env = dict(os.environ)
    if args.ifname:
        env["GLOO_SOCKET_IFNAME"] = args.ifname
    port = free_port(args.addr)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", __spec__.name, *argv, "--rank", str(r), "--port", str(port)], env=env
        )
        for r in range(args.np)
    ]
    code = 0
    while procs:
        for p in [p for p in procs if p.poll() is not None]:
            procs.remove(p)
            if p.returncode != 0 and code == 0:
                code = p.returncode
                for other in procs:  # one rank failed: the others would wait forever
                    other.terminate()
        time.sleep(0.05)
    return code


def main(argv: list[str] | None = None) -> int:
    """Launcher (no ``--rank``) or one rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop.add_args(parser)
    parser.add_argument("--np", type=int, required=True, help="number of ranks")
    parser.add_argument("--rank", type=int, default=None, help="run as this rank (else: launch all)")
    parser.add_argument("--addr", default="127.0.0.1", help="TCP store address (rank 0 hosts it)")
    parser.add_argument("--port", type=int, default=0, help="TCP store port (the launcher picks one)")
    parser.add_argument("--ifname", default="lo", help="GLOO_SOCKET_IFNAME ('' = gloo picks)")
    parser.add_argument("--pg-timeout", type=float, default=300.0, help="gloo and store timeout (s)")
    args = parser.parse_args(argv)
    if args.rank is None:
        return launch(args, argv)
    return loop.run(GlooPeer(args.rank, args.np, args.addr, args.port, args.pg_timeout), args)


if __name__ == "__main__":
    sys.exit(main())
