"""pytorch_mnist.py ported to pycomm's native API (see the migration table in docs/horovod.md).

Differences: pycomm.init(), root= instead of root_rank=, pycomm.allreduce
reduces in place with op="avg" (Horovod: out of place, Average by default),
compression and op are strings.
"""
import argparse

import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import pycomm
from pytorch_mnist import Net, synthetic_mnist


def metric_average(val, name):
    tensor = torch.tensor(val)
    pycomm.allreduce(tensor, op="avg", name=name)
    return tensor.item()


def main(argv=None):
    parser = argparse.ArgumentParser(description="PyTorch MNIST-like example (pycomm native)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--test-batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--train-samples", type=int, default=192)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    args = parser.parse_args(argv)

    pycomm.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic_mnist(args.train_samples, seed=1)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=pycomm.size(), rank=pycomm.rank(), shuffle=False)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = synthetic_mnist(96, seed=2)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=pycomm.size(), rank=pycomm.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * pycomm.size(), momentum=args.momentum)
    pycomm.broadcast_parameters(model.state_dict(), root=0)
    pycomm.broadcast_optimizer_state(optimizer, root=0)
    optimizer = pycomm.DistributedOptimizer(optimizer, model.named_parameters(),
                                            compression="fp16" if args.fp16_allreduce else "none", op="avg")

    history = {"train_loss": [], "test_loss": [], "test_accuracy": []}
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            history["train_loss"].append(metric_average(loss.item(), "train_loss"))
        model.eval()
        test_loss, test_accuracy = 0., 0.
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).float().sum().item()
        history["test_loss"].append(metric_average(test_loss / len(test_sampler), "avg_loss"))
        history["test_accuracy"].append(metric_average(test_accuracy / len(test_sampler), "avg_accuracy"))
    history["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return history


if __name__ == "__main__":
    main()
