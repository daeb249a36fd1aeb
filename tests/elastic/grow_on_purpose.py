"""An elastic job that adds ranks on purpose: pycomm.elastic.grow(GROW) at step GROW_STEP (after a commit).

Run by tests/test_elastic.py under `mpirun --with-ft ulfm`. Every rank prints
  rank R joined J size N          (at start; J: started by grow)
  rank R final-size N step S sha SHA allreduce A
  rank R group-sum G member M
where A is an allreduce of ones over the final world (it must equal N), and G one over the group of the
first two ranks, made before the grow and made again after it (2 on its members, 1 elsewhere).
"""
import hashlib
import os
import time

import torch

import pycomm
import pycomm.elastic as elastic

pycomm.init(elastic=True)
grow_by = int(os.environ.get("GROW", "1"))
grow_step = int(os.environ.get("GROW_STEP", "5"))
steps = int(os.environ.get("STEPS", "20"))
print(f"rank {pycomm.rank()} joined {int(elastic.joined())} size {pycomm.size()}", flush=True)

torch.manual_seed(pycomm.rank())  # different on every rank: sync() must make them one
model = torch.nn.Linear(8, 2)
optimizer = pycomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
state = elastic.TorchState(model, optimizer, step=0)
group = pycomm.new_group([0, 1])  # collective over its members only: a joined rank is outside it
resets = []
state.register_reset_callbacks([lambda: resets.append(pycomm.size())])


@elastic.run(state)
def train(state):
    while state.step < steps:
        if state.step == grow_step and pycomm.size() < 2 + grow_by:
            t0 = time.time()
            growth = elastic.grow(grow_by)  # raises WorldGrown inside run; unreachable past here
            raise AssertionError(f"grow returned {growth} inside run")
        g = torch.Generator().manual_seed(state.step * 100 + pycomm.rank())
        x = torch.randn(4, 8, generator=g)
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()
        state.step += 1
        state.commit()


train()
t = torch.ones(1)
pycomm.allreduce(t, op="sum")
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"rank {pycomm.rank()} final-size {pycomm.size()} step {state.step} sha {digest} allreduce {int(t.item())} "
      f"resets {resets} growths {elastic.growths}", flush=True)
g = torch.ones(1)
if group.is_member:
    pycomm.allreduce(g, op="sum", group=group)
print(f"rank {pycomm.rank()} group-sum {int(g.item())} member {int(group.is_member)}", flush=True)
