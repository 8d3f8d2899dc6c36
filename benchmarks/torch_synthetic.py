"""A synthetic PyTorch DDP benchmark written for ``torchrun``, as PyTorch users write one: a small convolutional
network on random images (nothing downloaded; ``torchvision`` is not needed), SGD, ``--warmup`` steps, then
``--steps`` timed steps; rank 0 prints ``{"images_per_s": ...}`` over all ranks.

    torchrun --nproc-per-node 2 benchmarks/torch_synthetic.py --steps 60
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--steps", type=int, default=60)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Flatten(), torch.nn.Linear(64 * (args.image_size // 4) ** 2, 10))
model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
labels = torch.randint(0, 10, (args.batch_size,))


def step():
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()


for _ in range(args.warmup):
    step()
dist.barrier()
t0 = time.perf_counter()
for _ in range(args.steps):
    step()
dist.barrier()
seconds = time.perf_counter() - t0
if dist.get_rank() == 0:
    print(json.dumps({"images_per_s": args.steps * args.batch_size * dist.get_world_size() / seconds}), flush=True)
dist.destroy_process_group()
