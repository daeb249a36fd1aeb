"""A Horovod PyTorch script in the shape of Horovod's examples/pytorch/pytorch_synthetic_benchmark.py.

Written against ``import horovod.torch as hvd``; the tests swap only that line
for ``import pycomm.horovod as hvd``. The model is a small CNN (the original
uses torchvision's resnet50) so that it runs in seconds on a CPU.
"""
import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import horovod.torch as hvd


class SmallNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main(argv=None):
    parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-warmup-batches", type=int, default=1)
    parser.add_argument("--num-batches-per-iter", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--use-adasum", action="store_true", default=False)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    model = SmallNet()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Each rank its own synthetic batch (fixed by the seed and the rank).
    g = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    data = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    target = torch.randint(0, 10, (args.batch_size,), generator=g)
    losses = []

    def benchmark_step():
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    def log(s):
        if hvd.rank() == 0:
            print(s)

    log(f"Model: SmallNet, batch size: {args.batch_size}, number of ranks: {hvd.size()}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per rank: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


if __name__ == "__main__":
    main()
