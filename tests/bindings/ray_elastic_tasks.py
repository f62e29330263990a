"""Functions the elastic Ray tests send to ElasticRingcoreExecutor workers.

``train`` is an elastic numpy job (``examples/elastic_numpy.py``'s model): a
linear model learns ``y = x @ w_true`` from batches every rank draws alike,
each rank taking its share of the batch's samples, the gradients summed with
``ringcore.allreduce``, a commit after every step. Rank 0 writes
``OUT/progress`` (``epoch batch size``) after every step, so a test can kill a
worker mid-epoch. With ``hold_until`` the ranks keep committing after the last
step until the world has that many ranks (a replacement joins at a commit).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

import ringcore
import ringcore.elastic

BATCH, FEATURES, LR = 12, 256, np.float32(0.05)  # 12 samples: an equal share for 1, 2, 3, 4 or 6 ranks
W_TRUE = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)


def batch(epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The same batch on every rank."""
    x = np.random.default_rng([epoch, step]).standard_normal((BATCH, FEATURES)).astype(np.float32)
    return x, x @ W_TRUE


def step(w: np.ndarray, epoch: int, index: int, rank: int, size: int) -> np.ndarray:
    """This rank's share of the batch's gradient (summed over its samples)."""
    x, y = batch(epoch, index)
    mine = np.array_split(np.arange(BATCH), size)[rank]
    return x[mine].T @ (x[mine] @ w - y[mine])


def reference(epochs: int, batches: int) -> np.ndarray:
    """The parameters one process reaches on the whole batches."""
    w = np.zeros(FEATURES, np.float32)
    for epoch in range(epochs):
        for index in range(batches):
            w -= LR * step(w, epoch, index, 0, 1) / BATCH
    return w


def train(
    out: str, epochs: int = 3, batches: int = 12, step_s: float = 0.05, hold_until: int = 0
) -> dict[str, Any]:
    """Train elastically; return this rank's committed state and what it saw."""
    ringcore.init()  # joins the driver's first generation (or, for a replacement, the next one)
    progress = Path(out) / "progress"
    resets: list[int] = []
    state = ringcore.elastic.State(epoch=0, batch=0, steps=0, w=np.zeros(FEATURES, np.float32))
    state.register_reset_callbacks([lambda: resets.append(ringcore.size())])

    @ringcore.elastic.run
    def loop(state: ringcore.elastic.State) -> None:
        while state.epoch < epochs:
            while state.batch < batches:
                grad = step(state.w, state.epoch, state.batch, ringcore.rank(), ringcore.size())
                ringcore.allreduce(grad, op="sum")
                state.w -= LR * grad / BATCH
                state.batch += 1
                state.steps += 1
                if ringcore.rank() == 0:
                    progress.write_text(f"{state.epoch} {state.batch} {ringcore.size()}")
                time.sleep(step_s)
                state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()
        deadline = time.monotonic() + 60
        while ringcore.size() < hold_until and time.monotonic() < deadline:
            time.sleep(0.05)
            state.commit()  # a newcomer waiting makes this commit raise HostsUpdatedInterrupt

    loop(state)
    return {
        "worker": int(os.environ["RINGCORE_ELASTIC_WORKER"]),
        "pid": os.getpid(),
        "rank": ringcore.rank(),
        "size": ringcore.size(),
        "epoch": state.epoch,
        "batch": state.batch,
        "steps": state.steps,
        "digest": hashlib.sha256(state.w.tobytes()).hexdigest(),
        "w": state.w.copy(),
        "resets": resets,
    }


def raise_on(worker: int) -> None:
    """Worker ``worker`` raises an error of its own once it is in the first generation."""
    ringcore.init()
    if int(os.environ["RINGCORE_ELASTIC_WORKER"]) == worker:
        raise ValueError(f"boom on worker {worker}")
    while True:
        ringcore.allreduce(np.ones(100, np.float32))  # the others wait in a collective
