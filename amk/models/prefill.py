"""Prefill: a prompt goes through the model's step in blocks of T tokens, not one token a step.

The block is the decode step itself, traced with T rows: token ids int32 [T] and positions int32
[T] (row t at position pos[t]); rope, kv_update and attention then treat each row at its own
position, attention causal over the cache (docs/PROGRAM.md). Each block size is one compiled
program, so a prompt is cut into chunks of a few fixed sizes (`CHUNK_SIZES`): full chunks of the
largest, then of smaller sizes; a rest that fills at least 3/4 of a size runs as one chunk of that
size, padded (a chunk costs a fixed ~276 launches plus one read of the weights on the triton
backend, a padding row only its compute), and the last few tokens (fewer than the smallest
size) as one chunk of the smallest size, padded. A 1000-token prompt: 512 + 512 (488 real), not
7 x 128 + 7 x 16. Padding rows sit at
positions past the prompt: causal attention keeps them out of every real row, and the decode
steps that follow overwrite their cache rows before anything reads them (a decode step at pos p
writes row p and reads rows <= p).

The chunk program computes the final norm and LM head on its last row only (Model.prefill_jit:
logits [1, V]), so a padded chunk puts its last real token in that row: rows are the first
tokens - 1 real tokens, then the padding, then the last real token (`row_positions`). Every
op reads a row's own position (kv_update writes row t to cache row pos[t], attention is causal
by pos[t]), so the order of the rows changes nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from amk.errors import TraceError

CHUNK_SIZES = (512, 128, 16)   # compiled block sizes; 1 (the decode step) is always available
PAD_FRACTION = 4               # a padded chunk is at most 1/4 padding (besides the smallest size's)


@dataclass(frozen=True)
class Chunk:
    start: int     # position of the chunk's first row
    size: int      # rows of the program that runs it (its compiled block size)
    tokens: int    # real prompt tokens in it (the rest is padding)


def plan_chunks(n_tokens: int, start: int, max_seq: int,
                sizes: tuple[int, ...] = CHUNK_SIZES) -> list[Chunk]:
    """Chunks covering prompt positions [start, start + n_tokens), padded rows inside max_seq."""
    if any(int(s) < 1 for s in sizes):
        raise TraceError(f"prefill: chunk sizes must be positive, got {sizes}")
    sizes = tuple(sorted({int(s) for s in sizes} | {1}, reverse=True))
    if n_tokens < 0 or start < 0 or start + n_tokens > max_seq:
        raise TraceError(f"prefill: positions {start}..{start + n_tokens} do not fit the cache's "
                         f"{max_seq} rows; build the model with a larger max_seq")
    chunks, pos, left = [], start, n_tokens
    smallest = min(s for s in sizes if s > 1) if len(sizes) > 1 else 1
    while left > 0:
        size = real = next(s for s in sizes if s <= left)     # unpadded while a size fits
        up = min((s for s in sizes if s > left and pos + s <= max_seq), default=None)
        if up is not None and (up == smallest or up - left <= up // PAD_FRACTION):
            size, real = up, left                             # the rest: one padded chunk
        chunks.append(Chunk(pos, size, real))
        pos += real
        left -= real
    return chunks


def prefill(model, ids: torch.Tensor, kv: list, backend: str | None = None,
            sizes: tuple[int, ...] = CHUNK_SIZES, on_chunk=None) -> torch.Tensor:
    """Run the prompt ids [T] (one sequence) through the model in chunks, writing its K/V into
    kv (single-sequence caches [max_seq, ...], updated in place). Returns the logits [V] of the
    last prompt token. on_chunk(chunk) is called after each chunk ran."""
    ids = ids.reshape(-1).to(device=model.device, dtype=torch.int32)
    step = model.prefill_jit(backend)
    logits = None
    for c in plan_chunks(ids.numel(), 0, model.config.max_seq, sizes):
        params, tok, pos, _ = chunk_args(model, c, kv)   # size 1: the decode step's signature
        n = c.tokens - 1
        tok[:n] = ids[c.start:c.start + n]
        tok[c.size - 1] = ids[c.start + n]               # the last real token: the last row
        _, out_logits, kv = step(params, tok, pos, kv)
        logits = out_logits.reshape(-1)                   # [V]: the last row's
        if on_chunk is not None:
            on_chunk(c)
    return logits


def chunk_args(model, chunk: Chunk, kv: list):
    """(params, token ids, positions, kv) of a chunk's program, for lowering it ahead of time."""
    tok = torch.zeros(chunk.size, dtype=torch.int32, device=model.device)
    pos = row_positions(chunk, model.device)
    return model.params, tok, pos, kv


def row_positions(chunk: Chunk, device=None) -> torch.Tensor:
    """int32 [size] on device: the position of each row of the chunk's program. The real tokens
    but the last, the padding (positions past the prompt), the last real token in the last row.
    Built on the device (no host-to-device copy, which would wait for the previous chunk)."""
    pos = torch.arange(chunk.start, chunk.start + chunk.size, dtype=torch.int32, device=device)
    if chunk.tokens < chunk.size:
        pos[chunk.tokens - 1:-1] += 1               # the padding, one row earlier
        pos[-1] = chunk.start + chunk.tokens - 1
    return pos


def compile_prefill(model, n_tokens: int, backend: str | None = None,
                    sizes: tuple[int, ...] = CHUNK_SIZES) -> list[int]:
    """Trace and compile the chunk programs a prompt of n_tokens needs (so the first token's
    time is not compile time); returns their block sizes."""
    step = model.prefill_jit(backend)
    kv = model.generation_kv()          # generate's caches: no second full-size allocation
    done = []
    for c in plan_chunks(n_tokens, 0, model.config.max_seq, sizes):
        if c.size not in done:
            step.lower(*chunk_args(model, c, kv))
            done.append(c.size)
    return done
