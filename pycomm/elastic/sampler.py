"""ElasticSampler: a distributed sampler that survives a change of world size within an epoch."""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Optional

import torch

from .. import runtime


class ElasticSampler(torch.utils.data.Sampler):
    """Partition a dataset over the ranks, skipping what the job has already processed this epoch.

    The epoch's order is a permutation drawn from ``seed + epoch`` (or the natural order without
    shuffle). ``record_batch(batch_idx, batch_size)`` after each step counts ``batch_size``
    samples per rank as processed; after a recovery ``reset()`` (called by TorchState.on_reset)
    partitions the samples not yet processed over the ranks now alive, so no sample of the
    epoch is skipped and none is seen twice, save the padding that makes every rank's share
    equal (the last samples repeated, as torch's DistributedSampler pads). ``set_epoch(e)``
    starts epoch ``e`` afresh. Its ``state_dict`` (epoch, processed) belongs in the TorchState.

    num_replicas / rank: default pycomm.size() / pycomm.rank() at each reset (given: fixed, for tests).
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed = 0  # samples of this epoch processed by the whole job
        self._fixed_replicas, self._fixed_rank = num_replicas, rank
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.processed = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One step took `batch_size` samples on each rank."""
        self.processed = min(len(self.dataset), self.processed + batch_size * self.num_replicas)

    def reset(self) -> None:
        """Partition the epoch's remaining samples over the current ranks."""
        self.num_replicas = self._fixed_replicas if self._fixed_replicas is not None else runtime.size()
        self.rank = self._fixed_rank if self._fixed_rank is not None else runtime.rank()
        remaining = self._epoch_order()[self.processed:]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        total = self.num_samples * self.num_replicas
        if remaining and total > len(remaining):  # pad by repeating from the start (fewer samples than ranks too)
            remaining = (remaining * math.ceil(total / len(remaining)))[:total]
        self._indices = remaining[self.rank:total:self.num_replicas]

    def _epoch_order(self) -> List[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "processed": self.processed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.processed = int(state["processed"])
        self.reset()
