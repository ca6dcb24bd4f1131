"""Megatron-LM's pretraining sampler and the DataLoader built on it.

The global sample stream is ``consumed_samples, consumed_samples + 1, ..., total_samples - 1``, cut into global
micro-batches of ``micro_batch_size * data_parallel_size`` consecutive indices; DP rank ``r`` takes the ``r``-th
slice of ``micro_batch_size`` of each. A trailing incomplete global micro-batch is dropped. Resuming is starting at
the saved ``consumed_samples`` (a multiple of the global micro-batch): the remaining index stream is exactly that of
an uninterrupted run.
"""

from __future__ import annotations

from typing import Iterator, List

import torch

from megatron_glm5.data.collate import collate


class MegatronPretrainingSampler:
    """Batch sampler yielding this DP rank's list of ``micro_batch_size`` indices per micro-batch."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: total_samples={total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} outside [0, total_samples={total_samples})")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"micro_batch_size {micro_batch_size} and data_parallel_size {data_parallel_size} "
                             f"must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} outside [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        n = (self.total_samples - self.consumed_samples) // self.micro_batch_times_data_parallel_size
        tail = (self.total_samples - self.consumed_samples) % self.micro_batch_times_data_parallel_size
        if not self.drop_last and tail > self.data_parallel_rank * self.micro_batch_size:
            n += 1
        return n

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_times_data_parallel_size
        lo = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + step <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += step
        if not self.drop_last and start + lo < self.total_samples:
            yield list(range(start + lo, min(start + lo + self.micro_batch_size, self.total_samples)))


def build_data_loader(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                      num_workers: int = 0) -> torch.utils.data.DataLoader:
    """A DataLoader over ``dataset`` for this DP rank, starting at ``consumed_samples``, batches through
    :func:`~megatron_glm5.data.collate.collate`."""
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate,
                                       pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0)
