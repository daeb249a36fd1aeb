"""Horovod's elastic PyTorch example shape (hvd.elastic.run, TorchState, ElasticSampler), run on pycomm.horovod.

Only the import differs from a Horovod script. Rank KILL_RANK kills itself at epoch 1, batch KILL_BATCH.
Each survivor prints "rank R final-size N sha SHA lr LR".
"""
import hashlib
import os
import signal

import torch
import torch.nn.functional as F

import pycomm.horovod as hvd

hvd.init()
kill_rank, kill_batch = int(os.environ["KILL_RANK"]), int(os.environ["KILL_BATCH"])
start_rank = hvd.rank()
torch.manual_seed(42)
dataset = torch.utils.data.TensorDataset(torch.randn(640, 20), torch.randint(0, 5, (640,)))
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
base_lr, batch_size, epochs = 0.01, 16, 3
optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * hvd.size(), momentum=0.5)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
train_sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True)
train_loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=train_sampler)


def on_state_reset():
    for group in optimizer.param_groups:  # Horovod's example: scale the learning rate by the new size
        group["lr"] = base_lr * hvd.size()


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        state.train_sampler.set_epoch(state.epoch) if state.batch == 0 else None
        for batch_idx, (data, target) in enumerate(train_loader):
            if start_rank == kill_rank and state.epoch == 1 and state.batch == kill_batch:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
            state.train_sampler.record_batch(batch_idx, batch_size)
            state.batch += 1
            state.commit()
        state.batch = 0


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=train_sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"rank {start_rank} final-size {hvd.size()} sha {digest} lr {optimizer.param_groups[0]['lr']:g}", flush=True)
