"""A Horovod PyTorch script in the shape of Horovod's examples/pytorch/pytorch_mnist.py.

Written against ``import horovod.torch as hvd``; the tests run it with that one
line replaced by ``import pycomm.horovod as hvd`` and nothing else changed.
The data is synthetic (MNIST-shaped, 28x28, 10 classes, a fixed seed).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import horovod.torch as hvd


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    images[:, 0, 10:18, 10:18] += labels.view(-1, 1, 1).float() / 5.0  # learnable signal
    return torch.utils.data.TensorDataset(images, labels)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def main(argv=None):
    parser = argparse.ArgumentParser(description="PyTorch MNIST-like example")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--test-batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--train-samples", type=int, default=192)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--use-adasum", action="store_true", default=False)
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    args = parser.parse_args(argv)

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic_mnist(args.train_samples, seed=1)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = synthetic_mnist(96, seed=2)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    history = {"train_loss": [], "test_loss": [], "test_accuracy": []}
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            history["train_loss"].append(metric_average(loss.item(), "train_loss"))

        model.eval()
        test_loss = 0.
        test_accuracy = 0.
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")
        history["test_loss"].append(test_loss)
        history["test_accuracy"].append(test_accuracy)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {100. * test_accuracy:.1f}%")
    history["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return history


if __name__ == "__main__":
    main()
