"""The README example: every collective once, checked against numpy, with a line per step.

Run it under any launcher:
    ringcore-run -np 4 python examples/allreduce_demo.py
    torchrun --nproc-per-node 3 examples/allreduce_demo.py
    mpirun -np 3 python examples/allreduce_demo.py
    python examples/allreduce_demo.py          # a world of size 1
"""

import time

import numpy as np

import ringcore

comm = ringcore.init()  # rank/size/address discovered from the launcher's environment
rank, size = ringcore.rank(), ringcore.size()
expected_sum = sum(range(size))

g = np.full(1_000_000, ringcore.rank(), dtype=np.float32)
start = time.perf_counter()
ringcore.allreduce(g)  # in place, returns g; every rank now holds sum over ranks
elapsed = time.perf_counter() - start
assert np.all(g == expected_sum), f"allreduce gave {g[:4]}, expected {expected_sum}"
print(
    f"rank {rank}/{size}: allreduce of {g.size:,} float32 -> every element {g[0]:g} "
    f"(sum of ranks 0..{size - 1}) in {elapsed * 1e3:.1f} ms"
)

ringcore.allreduce(g, op="avg")  # ops: sum, avg, min, max, prod
assert np.allclose(g, expected_sum)
ringcore.allreduce(g, compression="fp16")  # fp16 on the wire, accumulation in float32
assert np.allclose(g, expected_sum * size, rtol=1e-3)

s = ringcore.empty(1_000_000)  # float32 in symmetric memory: a collective, the same on every rank
s[...] = rank
ringcore.allreduce(s)  # on one host: each rank reads and writes the peers' arrays directly
assert np.all(s == expected_sum)

h = ringcore.allreduce_async(g)  # overlap with compute
busy = sum(i * i for i in range(10_000))
h.wait()

w = np.arange(8, dtype=np.float64) * (rank + 1)
ringcore.broadcast(w, root=0)  # in place
assert np.array_equal(w, np.arange(8, dtype=np.float64))

x = np.full((rank + 1, 2), rank, dtype=np.int64)
parts = ringcore.allgather(x)  # ranks' arrays concatenated along axis 0
assert parts.shape == (size * (size + 1) // 2, 2)

mine = ringcore.reduce_scatter(np.arange(10, dtype=np.float32), op="sum")
assert np.array_equal(mine, np.array_split(np.arange(10, dtype=np.float32) * size, size)[rank])
print(f"rank {rank}/{size}: broadcast, allgather {parts.shape}, reduce_scatter {mine.tolist()}: all checked")

ringcore.barrier()
ringcore.shutdown()
if rank == 0:
    print(f"ringcore demo: {size} process(es), every collective matched numpy")
