"""The soak batch: a long seeded run of mixed collectives, which the test rebuilds (plan and inputs) to check every result."""

from __future__ import annotations

from typing import Any

import numpy as np

SOAK_DTYPES = ("float32", "float64", "int32", "int64")


def soak_spec(seed: int, size: int, index: int) -> dict[str, Any]:
    """Collective number ``index`` of a soak run: the same on every rank and in the test."""
    rng = np.random.default_rng([seed, index])
    kind = str(
        rng.choice(
            [
                "allreduce",
                "allreduce",
                "allreduce",
                "async",
                "broadcast",
                "allgather",
                "reduce_scatter",
                "barrier",
            ]
        )
    )
    dtype = str(rng.choice(SOAK_DTYPES))
    count = int(rng.integers(50_000, 200_000)) if rng.random() < 0.02 else int(rng.integers(0, 3000))
    if rng.random() < 0.05:
        count = int(rng.integers(0, size + 1))  # fewer elements than ranks
    floating = dtype.startswith("float")
    op = str(rng.choice(["sum", "avg", "min", "max", "prod"] if floating else ["sum", "min", "max", "prod"]))
    compression = "fp16" if floating and op != "prod" and rng.random() < 0.15 else None
    return {
        "kind": kind,
        "dtype": dtype,
        "count": count,
        "op": op,
        "compression": compression,
        "root": int(rng.integers(0, size)),
        "rows": [int(n) for n in rng.integers(0, 40, size)],  # allgather: rows per rank may differ
        "width": int(rng.integers(1, 5)),
        "batch": int(rng.integers(2, 4)),
    }


def soak_input(seed: int, rank: int, index: int, spec: dict[str, Any], part: int = 0) -> np.ndarray:
    """This rank's input to collective ``index`` (``part`` numbers the buffers of an async batch)."""
    rng = np.random.default_rng([seed, index, rank, part])
    dtype = np.dtype(spec["dtype"])
    if spec["kind"] == "allgather":
        shape: tuple[int, ...] = (spec["rows"][rank], spec["width"])
    elif spec["kind"] == "reduce_scatter":
        shape = (max(1, spec["count"] // spec["width"]), spec["width"])
    else:
        shape = (spec["count"],)
    if spec["op"] == "prod":
        values = rng.choice([-1, 1, 2], size=shape) if dtype.kind == "i" else rng.uniform(0.5, 1.5, shape)
    elif dtype.kind == "i":
        values = rng.integers(-1000, 1000, size=shape)
    else:
        values = rng.uniform(-1, 1, shape)
    return values.astype(dtype)


def soak(comm: Any, seed: int, total: int) -> list[Any]:
    """Run ``total`` mixed collectives (see ``soak_spec``), sleeping 0-2 ms before some; return the results."""
    import time

    delays = np.random.default_rng([seed, comm.rank, 999])
    out: list[Any] = []
    for index in range(total):
        spec = soak_spec(seed, comm.size, index)
        if delays.random() < 0.25:
            time.sleep(delays.uniform(0, 0.002))
        kind, name = spec["kind"], f"soak.{index}"
        x = soak_input(seed, comm.rank, index, spec)
        if kind == "allreduce":
            out.append(comm.allreduce(x, op=spec["op"], compression=spec["compression"], name=name))
        elif kind == "async":
            bufs = [x] + [soak_input(seed, comm.rank, index, spec, part) for part in range(1, spec["batch"])]
            handles = [comm.allreduce_async(b, op=spec["op"], compression=spec["compression"]) for b in bufs]
            out.append([h.wait(timeout=60) for h in handles])
        elif kind == "broadcast":
            out.append(comm.broadcast(x, root=spec["root"], name=name))
        elif kind == "allgather":
            out.append(comm.allgather(x, name=name))
        elif kind == "reduce_scatter":
            out.append(comm.reduce_scatter(x, op=spec["op"], compression=spec["compression"], name=name))
        else:
            comm.barrier()
            out.append(None)
    return out
