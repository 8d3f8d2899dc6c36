"""Digits with PyTorch's DistributedDataParallel, written the way PyTorch's own examples are: for ``torchrun``.

    torchrun --nproc-per-node 2 torchrun_digits.py --epochs 3

In a notebook, the same file runs unchanged on a TrainingSession's ranks (``backend="torch"``):

    session.run_script("torchrun_digits.py", ["--epochs", "3"])

Its one line for the session, ``jupyter_hpcdl.report(loss=...)``, adds the loss to the live step metrics (the step
times stream without it); without jupyter-hpcdl installed the script runs all the same.
"""
import argparse
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:
    from jupyter_hpcdl import report
except ImportError:
    def report(**figures):
        pass

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.01)
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world_size, local_rank = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
# torchrun shows every rank all of the node's GPUs; a batch system may bind one to each rank: either way this is
# the rank's own
device = torch.device("cuda", local_rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")

x, y = load_digits(return_X_y=True)
data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).to(device)
model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
loss_fn = torch.nn.CrossEntropyLoss()

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(xb.to(device)), yb.to(device))
        loss.backward()
        optimizer.step()
        report(loss=loss.item())
    if rank == 0:
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)

if rank == 0:
    print(f"final loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
