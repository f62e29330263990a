"""OpenMPI allreduce through mpi4py: ``Allreduce(IN_PLACE, buf, SUM)`` on float32 numpy arrays.

Start it with mpirun; the MCA parameters choose the transport, e.g.::

    mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl self,tcp \\
        --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo \\
        python -m ringcore.bench.peers.mpi_worker --sizes 4K,1M --iters 20
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ringcore.bench.peers import loop


class MpiPeer:
    """:class:`loop.Peer` over ``MPI.COMM_WORLD``."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def allreduce(self, buf: np.ndarray) -> None:
        """Sum in place."""
        self.comm.Allreduce(self.mpi.IN_PLACE, [buf, self.mpi.FLOAT], op=self.mpi.SUM)

    def barrier(self) -> None:
        """MPI_Barrier."""
        self.comm.Barrier()

    def allgather(self, values: np.ndarray) -> np.ndarray:
        """Stack every rank's ``values`` as ``(size, len)``."""
        mine = np.ascontiguousarray(values)
        out = np.empty((self.size, mine.size), dtype=mine.dtype)
        self.comm.Allgather(mine, out)
        return out


def main(argv: list[str] | None = None) -> int:
    """One rank; mpirun starts them all."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loop.add_args(parser)
    args = parser.parse_args(argv)
    return loop.run(MpiPeer(), args)


if __name__ == "__main__":
    sys.exit(main())
