"""ringcore on a Ray cluster: a RingcoreExecutor job, then Ray Train's TorchTrainer on the "ringcore" backend.

    python examples/ray_digits.py                      # a local Ray instance (or RAY_ADDRESS's cluster)
    python examples/ray_digits.py --workers 4 --epochs 5

Needs ``pip install 'ringcore[ray,torch]' scikit-learn``. No launcher: Ray places
the workers, and ringcore's setup hook registers the backend in each of them.
"""

import argparse
import os
import tempfile

import numpy as np
import ray
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer, prepare_model
from sklearn.datasets import load_digits

import ringcore
import ringcore.ray


def add_ranks() -> float:
    """Runs on every rank of the executor: a plain ringcore job."""
    ringcore.init()  # rank, size, address and secret come from the executor
    x = np.full(1000, ringcore.rank(), dtype=np.float32)
    ringcore.allreduce(x)
    ringcore.shutdown()
    return float(x[0])


def train_digits(config: dict) -> None:
    """Runs on every Ray Train worker, after Ray made the "ringcore" process group."""
    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    mine = np.array_split(np.arange(len(y)), size)[rank]  # this worker's shard
    model = prepare_model(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(config["epochs"]):
        order = np.random.default_rng(epoch).permutation(mine)
        for start in range(0, len(order) - 31, 32):
            rows = torch.from_numpy(order[start : start + 32])
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
            loss.backward()  # DDP averages the gradients over the ringcore process group
            optimizer.step()
        with torch.no_grad():
            accuracy = float((model(x).argmax(1) == y).float().mean())
        metrics = {"epoch": epoch, "loss": float(loss.detach()), "accuracy": accuracy}
        with tempfile.TemporaryDirectory() as folder:  # rank 0 saves the model: Ray keeps it in storage
            checkpoint = None
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(folder, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage-path", default=None, help="Ray Train's results (default ~/ray_results)")
    args = parser.parse_args()

    ray.init(runtime_env=ringcore.ray.RUNTIME_ENV)  # ringcore's worker_process_setup_hook, in every worker

    with ringcore.ray.RingcoreExecutor(num_workers=args.workers, cpus_per_worker=1) as executor:
        sums = executor.run(add_ranks)  # one result per rank, in rank order
    print(f"executor: {args.workers} ranks, each holds the sum of ranks {sums[0]:g}: {sums}")

    trainer = TorchTrainer(
        train_digits,
        train_loop_config={"epochs": args.epochs},
        scaling_config=ScalingConfig(num_workers=args.workers),
        torch_config=TorchConfig(backend="ringcore"),  # DDP on ringcore instead of gloo
        run_config=RunConfig(storage_path=args.storage_path),
    )
    result = trainer.fit()
    print(f"TorchTrainer on ringcore: accuracy {result.metrics['accuracy']:.3f} after {args.epochs} epochs")
    print(f"model saved in {result.checkpoint.path}")


if __name__ == "__main__":
    main()
