"""pytorch_synthetic_benchmark.py ported to pycomm's native API (losses only, no timing)."""
import argparse

import torch
import torch.nn.functional as F
import torch.optim as optim

import pycomm
from pytorch_synthetic_benchmark import SmallNet


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-warmup-batches", type=int, default=1)
    parser.add_argument("--num-batches-per-iter", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    pycomm.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = SmallNet()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * pycomm.size())
    optimizer = pycomm.DistributedOptimizer(optimizer, model.named_parameters(),
                                            compression="fp16" if args.fp16_allreduce else "none")
    pycomm.broadcast_parameters(model.state_dict(), root=0)
    pycomm.broadcast_optimizer_state(optimizer, root=0)
    g = torch.Generator().manual_seed(args.seed * 1000 + pycomm.rank())
    data = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    target = torch.randint(0, 10, (args.batch_size,), generator=g)
    losses = []
    for _ in range(args.num_warmup_batches + args.num_iters * args.num_batches_per_iter):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


if __name__ == "__main__":
    main()
