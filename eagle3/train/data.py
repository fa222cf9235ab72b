"""Batches for the train loop: epoch plans, sequence packing, collation, sharding over ranks.

An epoch's plan is a pure function of (sample lengths, seed, epoch, row length, packing): samples
in a seeded random order, packed greedily into rows of at most ``max_len`` tokens (or one sample
per row without packing). A global optimizer step takes the next ``G = batch_size * grad_accum *
world_size`` rows; rank r's accumulation micro-batch a is rows ``[(a*W + r)*B, +B)`` of them. So
the global batch of a step does not depend on how it is split over processes, and the data
position of a resumed run is just the step number.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import torch


@dataclass
class EpochPlan:
    rows: List[List[int]]  # sample indices per row

    def micro_batch(self, step_in_epoch: int, accum_index: int, rank: int, batch_size: int,
                    grad_accum: int, world_size: int) -> List[List[int]]:
        g = batch_size * grad_accum * world_size
        first = step_in_epoch * g + (accum_index * world_size + rank) * batch_size
        return self.rows[first:first + batch_size]


def plan_epoch(lengths: Sequence[int], max_len: int, seed: int, epoch: int, packing: bool,
               shuffle: bool = True) -> EpochPlan:
    """Rows of sample indices for one epoch. Samples with fewer than 3 tokens (no loss position:
    step 0 at index t predicts token t+2) are left out; longer samples are cut to ``max_len``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.arange(len(lengths))
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
    rows, cur, cur_len = [], [], 0
    for i in order.tolist():
        n = min(int(lengths[i]), max_len)
        if n < 3:
            continue
        if not packing:
            rows.append([i])
            continue
        if cur and cur_len + n > max_len:
            rows.append(cur)
            cur, cur_len = [], 0
        cur.append(i)
        cur_len += n
    if cur:
        rows.append(cur)
    return EpochPlan(rows)


def steps_per_epoch(plan: EpochPlan, batch_size: int, grad_accum: int, world_size: int) -> int:
    return len(plan.rows) // (batch_size * grad_accum * world_size)


def collate(rows: List[List[dict]], max_len: int, pad_to_multiple: int = 1) -> dict:
    """Rows of store items -> batch tensors [B, T]: a packed row holds several documents with
    their own positions (from 0) and document ids; padding has doc id -1 and no loss."""
    row_lens = [sum(min(len(it["input_ids"]), max_len) for it in row) for row in rows]
    T = max(row_lens)
    T = -(-T // pad_to_multiple) * pad_to_multiple
    first = rows[0][0]
    n_aux, H = first["aux_hidden_states"].shape[1:]
    dtype = first["aux_hidden_states"].dtype
    B = len(rows)
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long),
           "loss_mask": torch.zeros(B, T, dtype=torch.long),
           "position_ids": torch.zeros(B, T, dtype=torch.long),
           "doc_ids": torch.full((B, T), -1, dtype=torch.long),
           "aux_hidden_states": torch.zeros(B, T, n_aux * H, dtype=dtype),
           "last_hidden_state": torch.zeros(B, T, H, dtype=dtype)}
    for b, row in enumerate(rows):
        pos = 0
        for d, it in enumerate(row):
            n = min(len(it["input_ids"]), max_len - pos)
            if n <= 0:
                break
            sl = slice(pos, pos + n)
            out["input_ids"][b, sl] = it["input_ids"][:n]
            out["loss_mask"][b, sl] = it["loss_mask"][:n].long()
            out["position_ids"][b, sl] = torch.arange(n)
            out["doc_ids"][b, sl] = d
            out["aux_hidden_states"][b, sl] = it["aux_hidden_states"][:n].reshape(n, n_aux * H)
            out["last_hidden_state"][b, sl] = it["last_hidden_state"][:n]
            pos += n
    out["num_tokens"] = torch.tensor(sum(row_lens))
    return out


class MicroBatches(torch.utils.data.Dataset):
    """Item k = the collated k-th micro-batch of a list of micro-batches (rows of sample ids)."""

    def __init__(self, store, micro_batches: List[List[List[int]]], max_len: int, pad_to_multiple: int = 1):
        self.store = store
        self.micro_batches = micro_batches
        self.max_len = max_len
        self.pad_to_multiple = pad_to_multiple

    def __len__(self):
        return len(self.micro_batches)

    def __getitem__(self, k):
        rows = [[self.store[i] for i in row] for row in self.micro_batches[k]]
        return collate(rows, self.max_len, self.pad_to_multiple)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
