"""Elastic training on Ray: an actor is killed, the others go on from their last commit, a replacement joins.

    python examples/ray_elastic.py          # a local Ray cluster of 4 CPUs; rank 1 is killed mid-training
    python examples/ray_elastic.py --address auto --no-kill   # an existing cluster, no fault

The model is ``examples/elastic_numpy.py``'s: a linear model learns
``y = x @ w_true`` from batches every rank draws alike; each rank takes its
share of a batch, the ranks sum their gradients with ``ringcore.allreduce``,
and every step ends with ``state.commit()``. ``ElasticRingcoreExecutor``
serves the job's store in this process, starts one actor per worker, and
starts a replacement when Ray has a free CPU for one.
"""

import argparse
import logging
import threading
import time

import numpy as np
import ray

import ringcore
import ringcore.elastic
import ringcore.ray

EPOCHS, STEPS, BATCH, FEATURES, LR = 5, 40, 60, 256, 0.1


def train() -> dict:
    """One worker, as a script under an elastic ringcore-run would be."""
    w_true = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)
    ringcore.init()  # joins the executor's first generation (a replacement: the next one)
    state = ringcore.elastic.State(epoch=0, step=0, w=np.zeros(FEATURES, np.float32))

    @ringcore.elastic.run
    def loop(state: ringcore.elastic.State) -> None:
        while state.epoch < EPOCHS:
            while state.step < STEPS:
                x = np.random.default_rng([state.epoch, state.step]).standard_normal((BATCH, FEATURES))
                x = x.astype(np.float32)
                mine = np.array_split(np.arange(BATCH), ringcore.size())[ringcore.rank()]
                grad = x[mine].T @ (x[mine] @ state.w - x[mine] @ w_true)
                ringcore.allreduce(grad, op="sum")  # the gradient summed over the whole batch
                state.w -= LR * grad / BATCH
                state.step += 1
                time.sleep(0.05)  # stands in for a real model's compute
                state.commit()  # a failure rolls back to here
            state.epoch, state.step = state.epoch + 1, 0
            state.commit()

    loop(state)
    return {"rank": ringcore.rank(), "size": ringcore.size(), "error": float(np.abs(state.w - w_true).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    parser.add_argument("--no-kill", action="store_true", help="kill no actor")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the executor logs each generation
    ray.init(address=args.address, num_cpus=None if args.address else 4)
    executor = ringcore.ray.ElasticRingcoreExecutor(
        min_workers=2, max_workers=4, env={"OMP_NUM_THREADS": "1"}, failure_cooldown_s=1
    )
    if not args.no_kill:

        def kill_one() -> None:  # rank 1, two seconds into the first generation of 4
            while len(executor.members) < 4:
                time.sleep(0.1)
            time.sleep(2)
            worker = executor.members[1]
            victim = executor.workers().get(worker)
            if victim is not None:
                print(f"killing worker {worker}", flush=True)
                ray.kill(victim)

        threading.Thread(target=kill_one, daemon=True).start()
    for result in executor.run(train):
        print(result)
    print(f"{executor.generation} generations; the last one's workers: {executor.members}")
    ray.shutdown()


if __name__ == "__main__":
    main()
