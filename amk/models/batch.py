"""Continuous batching at the API level: a fixed number of sequence slots that decode together,
each at its own position, where a finished sequence's slot takes a new prompt while the others
go on.

    batch = model.batch(slots=4)               # or Batch(model, 4, backend="reference")
    a = batch.add(tokenizer("Hello").input_ids)   # prefills into a free slot; its first token
    b = batch.add(other_prompt)
    for _ in range(16):
        new = batch.step()                      # {slot: next token} for every busy slot
        if new[a] == eos:
            batch.release(a)                    # the slot is free for the next add()
            a = batch.add(next_prompt)

Every slot's tokens are those of generating its prompt alone (greedy; sampled ones follow the
batch's one seeded generator). One decode program serves every step: the position input is
int32 [slots], and a free slot's row is computed too (at position 0 of its own cache, which the
next prompt's prefill overwrites).
"""
from __future__ import annotations

import torch

from amk.errors import TraceError
from amk.models.generate import kv_of_sequence
from amk.models.prefill import CHUNK_SIZES, prefill
from amk.models.sampling import Sampler, SamplingOptions


class Batch:
    def __init__(self, model, slots: int, backend: str | None = None,
                 sampling: SamplingOptions = SamplingOptions(),
                 chunk_sizes: tuple[int, ...] = CHUNK_SIZES):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
            raise TraceError(f"Batch: slots must be an integer >= 2 (one sequence: use "
                             f"Model.generate), got {slots!r}")
        self.model, self.slots, self.backend, self.chunk_sizes = model, slots, backend, chunk_sizes
        dev = model.device
        self.kv = model.new_kv(slots)
        self.pos = torch.zeros(slots, dtype=torch.int32, device=dev)     # each slot's next row
        self.token = torch.zeros(slots, dtype=torch.int32, device=dev)   # each slot's last token
        self.busy = [False] * slots
        self.sampler = Sampler(sampling, dev)
        self.step_fn = model.jit(backend)

    def add(self, prompt) -> int:
        """Prefill a prompt (ids or a string) into a free slot; returns the slot. Its first new
        token is `self.token[slot]`."""
        ids = self.model._one_prompt(prompt).to(self.model.device)
        if ids.numel() == 0 or ids.numel() >= self.model.config.max_seq:
            raise TraceError(f"Batch.add: a prompt of {ids.numel()} tokens needs 1..max_seq-1 "
                             f"(max_seq {self.model.config.max_seq})")
        if all(self.busy):
            raise TraceError(f"Batch.add: all {self.slots} slots are busy; release one first")
        slot = self.busy.index(False)
        logits = prefill(self.model, ids, kv_of_sequence(self.kv, slot, self.slots), self.backend,
                         self.chunk_sizes)
        self.token[slot] = self.sampler.next(logits[None])[0]
        self.pos[slot] = ids.numel()
        self.busy[slot] = True
        return slot

    def step(self) -> dict[int, int]:
        """One decode step of every slot: {slot: its next token} for the busy ones."""
        if not any(self.busy):
            raise TraceError("Batch.step: no slot holds a sequence; add() a prompt first")
        full = [s for s in range(self.slots) if self.busy[s]
                and int(self.pos[s]) >= self.model.config.max_seq]
        if full:
            raise TraceError(f"Batch.step: slots {full} reached max_seq "
                             f"{self.model.config.max_seq}; release them")
        greedy, logits, self.kv = self.step_fn(self.model.params, self.token, self.pos, self.kv)
        busy = torch.tensor(self.busy, device=self.pos.device)
        self.token = torch.where(busy, self.sampler.next(logits, greedy).to(torch.int32), self.token)
        self.pos += busy.to(torch.int32)          # a free slot stays at its position
        host = self.token.cpu().tolist()
        return {s: host[s] for s in range(self.slots) if self.busy[s]}

    def release(self, slot: int) -> None:
        """The sequence in `slot` is done: the slot takes the next add()."""
        if not 0 <= slot < self.slots or not self.busy[slot]:
            raise TraceError(f"Batch.release: slot {slot} holds no sequence")
        self.busy[slot] = False
        self.pos[slot] = 0
