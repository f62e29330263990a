"""An elastic numpy training job for ``tests/integration/test_elastic.py``, run under ``ringcore-run``.

Usage: ``python tests/elastic_task.py OUT_DIR [--epochs E] [--batches B] [--step-seconds S]
[--hold-until-size N] [--torch] [--kill W:E:B ...] [--die-joining W:N] [--stall W:E:B]``.

The model is a vector ``w`` (64 Ki float32) pulled towards per-sample targets;
each rank averages its shard of the batch's samples and the ranks average
their gradients with ``ringcore.allreduce``. With ``--torch`` it is a small
MLP trained by ``ringcore.torch``'s ``DistributedOptimizer`` (SGD with
momentum) in a ``TorchState``, with an ``ElasticSampler`` counting the epoch's
samples: each step checks that it has done exactly the committed batches' (a
wrong count after a rollback or a change of world fails the worker). ``--hold-until-size N``: after the last
batch the ranks keep committing until the world has N ranks. Every worker writes
``OUT_DIR/pid.<worker>`` at start and, once training returns,
``OUT_DIR/final.<worker>.json`` (epoch, batch, steps, digest of the
parameters, rank, size, generation, the sizes its reset callbacks saw). Rank 0
writes ``OUT_DIR/progress`` (``epoch batch size``) after every step; a victim
writes ``OUT_DIR/fault.<worker>`` (the time) just before its fault.

Faults come from inside the victim (by worker number), never from a timer:

- ``--kill W:E:B``: worker W SIGKILLs itself in the middle of the allreduce
  of epoch E, batch B (before its 2nd send of that allreduce);
- ``--die-joining W:N``: worker W SIGKILLs itself in its N-th rendezvous,
  after checking in and before meeting the generation's ranks;
- ``--stall W:E:B``: worker W SIGSTOPs itself in that allreduce.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import ringcore
import ringcore.elastic
from ringcore import elastic_rendezvous

COUNT = 1 << 16
SAMPLES = 12  # per batch: an equal shard for 1, 2, 3, 4 or 6 ranks
LR = np.float32(0.1)
WORKER = int(os.environ["RINGCORE_ELASTIC_WORKER"])


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--kill", action="append", default=[], metavar="W:E:B")
    parser.add_argument("--stall", action="append", default=[], metavar="W:E:B")
    parser.add_argument("--die-joining", metavar="W:N")
    parser.add_argument("--hold-until-size", type=int, default=0)
    parser.add_argument("--torch", action="store_true")
    return parser.parse_args()


def gradient(w: np.ndarray, basis: np.ndarray, epoch: int, batch: int, rank: int, size: int) -> np.ndarray:
    """This rank's shard's mean of ``w - target`` over the batch's samples."""
    weights = np.random.default_rng([epoch, batch]).standard_normal((SAMPLES, len(basis)), dtype=np.float32)
    mine = weights[rank * SAMPLES // size : (rank + 1) * SAMPLES // size]
    return w - mine.mean(axis=0) @ basis


def arm_fault(signum: int, stamp: Path) -> None:
    """Send this process ``signum`` just before its 2nd send from now on (inside the next collective),
    writing the wall-clock time to ``stamp`` first. A post in the shared-memory mailboxes (the
    one-shot collectives on one host) counts as a send."""
    transport = ringcore.communicator().transport
    posted = [0]
    isend, swap = transport.isend, getattr(transport, "swap", None)
    post = getattr(transport, "meet_posts", None) if getattr(transport, "mailbox", None) else None

    def count() -> None:
        posted[0] += 1
        if posted[0] == 2:
            stamp.write_text(repr(time.time()))
            os.kill(os.getpid(), signum)

    def counted_isend(*args: Any) -> Any:
        count()
        return isend(*args)

    def counted_swap(send: Any, *rest: Any) -> Any:
        if send is not None:
            count()
        return swap(send, *rest)

    def counted_post(*args: Any) -> Any:
        count()
        return post(*args)  # type: ignore[misc]

    transport.isend = counted_isend
    if swap is not None:
        transport.swap = counted_swap
    if post is not None:
        transport.meet_posts = counted_post


def die_joining(spec: str | None) -> None:
    """``W:N``: worker W dies in its N-th rendezvous, before it meets the generation."""
    if spec is None or int(spec.split(":")[0]) != WORKER:
        return
    nth, joins = int(spec.split(":")[1]), [0]
    meet = elastic_rendezvous.new_communicator

    def dying(*args: Any, **kwargs: Any) -> Any:
        joins[0] += 1
        if joins[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return meet(*args, **kwargs)

    elastic_rendezvous.new_communicator = dying  # type: ignore[assignment]


def faults(specs: list[str], signum: int) -> dict[tuple[int, int], int]:
    """``{(epoch, batch): signum}`` for this worker."""
    found = {}
    for spec in specs:
        worker, epoch, batch = map(int, spec.split(":"))
        if worker == WORKER:
            found[(epoch, batch)] = signum
    return found


def main() -> None:
    args = parse()
    args.out.mkdir(exist_ok=True)
    (args.out / f"pid.{WORKER}").write_text(str(os.getpid()))
    planned = {**faults(args.kill, signal.SIGKILL), **faults(args.stall, signal.SIGSTOP)}
    die_joining(args.die_joining)
    if args.torch:  # torch before init, as a script imports it at the top: a newcomer then joins ready
        importlib.import_module("ringcore.torch.elastic")
    ringcore.init()  # joins the first generation (ringcore.elastic is imported)
    state, step, digest = torch_model() if args.torch else numpy_model()
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(ringcore.size())])

    @ringcore.elastic.run
    def train(state: ringcore.elastic.State) -> None:
        while state.epoch < args.epochs:
            while state.batch < args.batches:
                if (signum := planned.pop((state.epoch, state.batch), None)) is not None:
                    arm_fault(signum, args.out / f"fault.{WORKER}")
                step(state)
                state.batch += 1
                state.steps += 1
                if ringcore.rank() == 0:
                    (args.out / "progress").write_text(f"{state.epoch} {state.batch} {ringcore.size()}")
                time.sleep(args.step_seconds)
                state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            if (sampler := getattr(state, "sampler", None)) is not None:
                sampler.set_epoch(state.epoch)
            state.commit()
        while ringcore.size() < args.hold_until_size:
            time.sleep(args.step_seconds)
            state.commit()

    train(state)
    rendezvous = ringcore.elastic._rendezvous
    final = {
        "epoch": state.epoch,
        "batch": state.batch,
        "steps": state.steps,
        "digest": digest(state),
        "rank": ringcore.rank(),
        "size": ringcore.size(),
        "generation": rendezvous.generation if rendezvous is not None else 0,
        "resets": resets,
        "sampler": state.sampler.state_dict() if args.torch else None,
    }
    (args.out / f"final.{WORKER}.json").write_text(json.dumps(final))
    print(f"final epoch={state.epoch} steps={state.steps} size={final['size']} digest={final['digest'][:12]}")
    sys.stdout.flush()


def numpy_model() -> tuple[Any, Any, Any]:
    """The state, one training step and a digest of the parameters, for the numpy model."""
    basis = np.random.default_rng(0).standard_normal((16, COUNT), dtype=np.float32)
    state = ringcore.elastic.State(epoch=0, batch=0, steps=0, w=np.zeros(COUNT, np.float32))

    def step(state: Any) -> None:
        g = gradient(state.w, basis, state.epoch, state.batch, ringcore.rank(), ringcore.size())
        ringcore.allreduce(g, op="avg", name="gradient")
        state.w -= LR * g

    return state, step, lambda state: hashlib.sha256(state.w.tobytes()).hexdigest()


def torch_model() -> tuple[Any, Any, Any]:
    """The same for an MLP under ``DistributedOptimizer`` in a ``TorchState``."""
    import torch

    import ringcore.torch as hvd
    import ringcore.torch.elastic

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = ringcore.torch.elastic.ElasticSampler(range(1 << 12), seed=1)  # more samples than any epoch's
    state = ringcore.torch.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, steps=0)
    here: dict[str, Any] = {"indices": None, "batch": 0}  # this pass over the sampler's shard

    def step(state: Any) -> None:
        if sampler.indices is not here["indices"]:  # resharded (epoch, rollback, sync): a new pass
            here["indices"], here["batch"] = sampler.indices, 0
        sampler.record_batch(here["batch"], SAMPLES // hvd.size())
        here["batch"] += 1
        if sampler.processed != (state.batch + 1) * SAMPLES or sampler.epoch != state.epoch:
            raise AssertionError(f"sampler {sampler.state_dict()} at epoch {state.epoch} batch {state.batch}")
        rng = torch.Generator().manual_seed(state.epoch * 1000 + state.batch)
        x, y = torch.randn(SAMPLES, 32, generator=rng), torch.randint(0, 4, (SAMPLES,), generator=rng)
        rank, size = hvd.rank(), hvd.size()
        shard = slice(rank * SAMPLES // size, (rank + 1) * SAMPLES // size)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
        optimizer.step()

    def digest(state: Any) -> str:
        tensors = [*model.state_dict().values(), *(s["momentum_buffer"] for s in optimizer.state.values())]
        return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()

    return state, step, digest


if __name__ == "__main__":
    main()
