"""A small elastic training job whose rank KILL_RANK kills itself (SIGKILL) before step KILL_STEP.

Run by tests/test_elastic.py under `mpirun --with-ft ulfm`. Every survivor prints
  rank R killed-at T           (the wall-clock time of the kill, from the victim, shared through a file)
  rank R step-after-kill T     (the first step that completes after the recovery)
  rank R final-size N sha SHA  (the world size at the end, and a hash of the model's bytes)
With PYCOMM_ELASTIC_MIN_NP / PYCOMM_ELASTIC_MAX_NP the survivors grow the job back; the spawned ranks are
named "new<rank>" and print step-after-kill too. Settings through the environment: KILL_RANK, KILL_STEP (-1: no kill), STEPS, KILL_FILE; and for a second
death SECOND_RANK with SECOND_STEP (it dies before that step) or SECOND_STEP=recovery (it dies inside the
first recovery, in its reset callback).
"""
import hashlib
import os
import signal
import time

import torch

import pycomm
import pycomm.elastic as elastic

pycomm.init(elastic=True)
kill_rank = int(os.environ["KILL_RANK"])
kill_step = int(os.environ["KILL_STEP"])
steps = int(os.environ.get("STEPS", "40"))
kill_file = os.environ["KILL_FILE"]
second_rank = int(os.environ.get("SECOND_RANK", "-1"))
second_step = os.environ.get("SECOND_STEP", "")
# The rank in the original world (ranks are renumbered after a shrink); a rank spawned to grow the job back
# (PYCOMM_ELASTIC_MAX_NP) is named "new" and its rank in the grown world, and never kills itself.
world_rank = pycomm.rank() if not elastic.joined() else f"new{pycomm.rank()}"

torch.manual_seed(1234)  # the same initial model everywhere; sync() makes it so anyway
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = pycomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                        model.named_parameters())
data = torch.utils.data.TensorDataset(torch.randn(4096, 16), torch.randint(0, 4, (4096,)))
sampler = elastic.ElasticSampler(data, shuffle=True, seed=7)
state = elastic.TorchState(model, optimizer, step=0, sampler=sampler)
after_kill = {"reported": False, "recovered": False}


def on_reset():
    if world_rank == second_rank and second_step == "recovery":
        os.kill(os.getpid(), signal.SIGKILL)
    after_kill["recovered"] = True


state.register_reset_callbacks([on_reset])


@elastic.run(state)
def train(state):
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=state.sampler)
    batches = iter(loader)
    while state.step < steps:
        if state.step == kill_step and world_rank == kill_rank:
            with open(kill_file, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if world_rank == second_rank and second_step.isdigit() and state.step == int(second_step):
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            x, y = next(batches)
        except StopIteration:
            state.sampler.set_epoch(state.sampler.epoch + 1)
            batches = iter(torch.utils.data.DataLoader(data, batch_size=8, sampler=state.sampler))
            x, y = next(batches)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        state.sampler.record_batch(0, 8)
        state.step += 1
        if after_kill["recovered"] and not after_kill["reported"]:
            after_kill["reported"] = True
            print(f"rank {world_rank} step-after-kill {time.time()!r}", flush=True)
        state.commit()


train()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
if after_kill["recovered"]:
    print(f"rank {world_rank} recoveries {elastic.recoveries} growths {elastic.growths}", flush=True)
print(f"rank {world_rank} final-size {pycomm.size()} step {state.step} sha {digest}", flush=True)
