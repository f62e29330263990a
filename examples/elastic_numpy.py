"""Elastic training with numpy: lose a worker (rank 0 too) or gain one, and training goes on.

    ringcore-run -np 4 --min-np 2 --max-np 4 python examples/elastic_numpy.py
    kill -9 <a worker's pid>       # the others roll back to the last commit and go on with 3

With a discovery script the world also grows into new slots:

    echo localhost:3 > hosts.txt
    ringcore-run --min-np 2 --max-np 4 --host-discovery-script 'cat hosts.txt' python examples/elastic_numpy.py
    echo localhost:4 > hosts.txt   # a fourth worker joins at the next commit

A linear model learns ``y = x @ w_true`` from batches of 60 samples; each rank
takes its share of a batch, the ranks sum their gradients with
``ringcore.allreduce``, and every step ends with ``state.commit()``.
``python examples/elastic_numpy.py 0.05`` sleeps 50 ms per step (default 10 ms),
to leave time for the kill.
"""

import sys
import time

import numpy as np

import ringcore
import ringcore.elastic  # before ringcore.init(): init() then joins the launcher's first generation

EPOCHS, STEPS, BATCH, FEATURES, LR = 5, 40, 60, 256, 0.1
STEP_SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 0.01
W_TRUE = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)


def batch(epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The same batch on every rank: its samples depend only on (epoch, step)."""
    x = np.random.default_rng([epoch, step]).standard_normal((BATCH, FEATURES)).astype(np.float32)
    return x, x @ W_TRUE


ringcore.init()
state = ringcore.elastic.State(epoch=0, step=0, w=np.zeros(FEATURES, np.float32))
state.register_reset_callbacks(
    [lambda: print(f"rank {ringcore.rank()}: now {ringcore.size()} ranks", flush=True)]
)


@ringcore.elastic.run
def train(state: ringcore.elastic.State) -> None:
    while state.epoch < EPOCHS:
        while state.step < STEPS:
            x, y = batch(state.epoch, state.step)
            mine = np.array_split(np.arange(BATCH), ringcore.size())[ringcore.rank()]  # this rank's samples
            grad = x[mine].T @ (x[mine] @ state.w - y[mine])
            ringcore.allreduce(grad, op="sum")  # every rank: the gradient summed over the whole batch
            state.w -= LR * grad / BATCH
            state.step += 1  # count the step, then commit: a rollback neither loses nor repeats it
            time.sleep(STEP_SECONDS)  # stands in for a real model's compute
            state.commit()  # an in-memory snapshot; a failure rolls back to here
        state.epoch, state.step = state.epoch + 1, 0
        state.commit()
        if ringcore.rank() == 0:
            error = float(np.abs(state.w - W_TRUE).max())
            print(
                f"epoch {state.epoch}: max |w - w_true| = {error:.2e} on {ringcore.size()} ranks", flush=True
            )


train(state)
if ringcore.rank() == 0:
    print(f"done: {state.epoch} epochs, {ringcore.size()} ranks at the end")
