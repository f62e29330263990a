"""Horovod-style training with ringcore.torch: an MLP on scikit-learn's digits, data split across ranks.

    ringcore-run -np 4 python examples/torch_digits.py
    torchrun --nproc-per-node 2 examples/torch_digits.py

Needs torch and scikit-learn (``pip install 'ringcore[torch]' scikit-learn``). The only
line that differs from a Horovod script is the import.
"""

import numpy as np
import torch
from sklearn.datasets import load_digits

import ringcore.torch as hvd

hvd.init()
torch.manual_seed(hvd.rank())  # different initial weights: broadcast_parameters makes them equal
torch.set_num_threads(1)

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)
mine = np.array_split(np.arange(len(y)), hvd.size())[hvd.rank()]  # this rank's shard

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

batch = 32
for epoch in range(5):
    order = torch.from_numpy(np.random.default_rng(epoch).permutation(mine))
    for start in range(0, len(order) - batch + 1, batch):
        rows = order[start : start + batch]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
        loss.backward()  # gradients are averaged over ranks while backward runs
        optimizer.step()
    last = hvd.join()  # a rank out of batches serves the others until all are out
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)  # it joined last: it stepped last
    with torch.no_grad():
        correct = (model(x[mine]).argmax(1) == y[mine]).sum()
    accuracy = float(hvd.allreduce(correct.float(), op=hvd.Sum)) / len(y)
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {float(loss.detach()):.3f}, accuracy on all digits {accuracy:.3f}")

weights = hvd.allgather_object(float(sum(p.detach().sum() for p in model.parameters())))
assert len(set(weights)) == 1, f"ranks disagree on the weights: {weights}"
if hvd.rank() == 0:
    print(f"ringcore.torch example: {hvd.size()} rank(s) trained identical models")
