"""split_kv: each decode ATTENTION_TILE becomes G kv-head groups x P KV shards (flash decoding).

Shard p of group g is an ATTENTION_TILE with PARTIAL_WRITE (flags bit 1) over piece p of P of
the LIVE window [0, pos+1) (kv_shard = p, kv_shards = P; regions.kv_window), restricted to the
q heads of kv head g (h_off, h_count): the shards split the context, not the cache's capacity,
so a user's 8K cache at position 127 still gives every shard 127/P rows. It writes rows
[h_off, h_off+h_count) of partial buffer p, an f32 ACTIVATION of [.., n_heads*(head_dim+2)]
(= [acc | m | l] per head). An empty shard writes acc=0, m=-inf, l=0, which the combine
weighs 0. One
ATTENTION_COMBINE per group merges its P partials into the group's heads of the output (or, at
batch 1, one over all heads: opts.combine_per_group False, so fuse can fold it into each reader;
on the cuda options only where the fold pays, below).

P = opts.attn_splits, or from the target: enough tasks to give every SM one (num_sms // G), but
no shard shorter than opts.kv_shard_min rows and no more than opts.max_kv_shards (what one
backend task may merge: 56 on cuda, where 1-2 kv heads at an 8K cache made 64 and failed to
compile). At batch 1 the one combine its readers fold in only where a reader can stage its x and
all P partials in opts.fold_partial_bytes (fold_fits); else one combine a kv group. P = 1 keeps one exact
(non-partial) task per group, or the one task as it is on a `whole_ops` target (one launch
already covers every group).
The split result equals the unsplit attention up to float rounding (online-softmax merge).

A batch (a cache per sequence [B, max_seq, ..], one query row each) is split by sequence too:
tasks of b_count sequences from b_off (sequences_per_task: one, unless B x G fills the SMs twice
over), each covering only its sequences, each at its own position (pos [B] or [1]). Their
partials are sequence-major, [1, B*n_heads*(head_dim+2)] (sequence b's heads at columns
b*n_heads*(head_dim+2)..: regions.py), so tasks of different sequences write different columns;
P counts the sequence groups too (num_sms // (G x groups): one shard a sequence at batch 16 on
an H200); at P = 1 a batch's tasks write their rows of y directly, as batch 1's do.

P is the capacity's count (tasks and partial buffers in the schedule). With a runtime pos the
shards also carry kv_shard_rows R (shard_rows: opts.kv_shard_min for a derived P, the rule P
came from; 1 for a forced opts.attn_splits): at run time only the first
L = clamp(live rows // R, 1, P) shards split the live window (regions.kv_window); the others
exit without writing, and the combine (given pos as its last input and the window's params)
merges only the first L partials (regions.combine_live). So a step's split-KV work follows the
live context, not the cache's size: at position 127 one shard does the work whatever max_seq.
"""
from __future__ import annotations

from amk.passes.options import PassOptions
from amk.gcpause import without_gc
from amk.passes.sync import rethreshold
from amk.program.ir import Buffer, BufferKind, DType, InstructionKind as K, Program, Task, Wait
from amk.program.regions import PARTIAL_WRITE


def shard_count(max_seq: int, groups: int, opts: PassOptions) -> int:
    if opts.attn_splits is not None:
        return max(1, min(int(opts.attn_splits), max_seq))
    by_sms = max(1, opts.target.num_sms // max(groups, 1))
    by_len = max(1, max_seq // max(opts.kv_shard_min, 1))
    return max(1, min(by_sms, by_len, opts.max_kv_shards or by_sms))


def fold_fits(nh: int, hd: int, P: int, opts: PassOptions) -> bool:
    """Whether a reader folding batch 1's one combine stages its x (f32 [nh*hd], 1024-aligned)
    and all P partials (f32 [acc | m | l] a head) in opts.fold_partial_bytes: one round trip.
    The fold never lowers P: fewer, longer shards cost more than the fold saves (Qwen3-0.6B at
    context 4096 with P 8, +100 us; the 8B's P 4, +230 us: NOTES v30, v33)."""
    x = -(-nh * hd * 4 // 1024) * 1024
    return x + P * nh * (hd + 2) * 4 <= opts.fold_partial_bytes


def shard_rows(opts: PassOptions) -> int:
    """R, the fewest rows a live shard gets at run time: a derived P's kv_shard_min (at a full
    cache every shard is live); a forced attn_splits splits from one row a shard up."""
    return 1 if opts.attn_splits is not None else max(int(opts.kv_shard_min), 1)


def sequences_per_task(batch: int, groups: int, opts: PassOptions) -> int:
    """Sequences a batched attention task covers: one while B x G tasks do not fill the SMs
    twice over, else the largest divisor of B up to B x G // num_sms (fewer, longer tasks)."""
    most = max(1, batch * groups // max(opts.target.num_sms, 1))
    return max(d for d in range(1, min(most, batch) + 1) if batch % d == 0)


def _batch(t: Task, bufs, nh: int, hd: int) -> int:
    """B, the sequences of an attention with a cache per sequence [B, max_seq, ..] and one
    query row each (a decode batch); 1 for anything else."""
    q, kc = bufs[t.inputs[0]], bufs[t.inputs[1]]
    if len(kc.shape) == 4 and kc.shape[0] > 1 and q.numel == kc.shape[0] * nh * hd:
        return kc.shape[0]
    return 1


def _splittable(t: Task, bufs) -> bool:
    p = t.params
    return (t.op is K.ATTENTION_TILE and not int(p.get("flags", 0)) & PARTIAL_WRITE
            and "h_off" not in p and len(t.inputs) >= 3 and "head_dim" in p and "n_heads" in p)


@without_gc
def split_kv(program: Program, opts: PassOptions | None = None) -> Program:
    opts = opts or PassOptions()
    bufs = list(program.buffers)
    next_counter = max((c.id for c in program.counters), default=-1) + 1
    out: list[Task] = []
    changed = False
    for t in program.tasks:
        if not _splittable(t, bufs):
            out.append(t)
            continue
        p = t.params
        hd, nh = int(p["head_dim"]), int(p["n_heads"])
        nkv = int(p.get("n_kv_heads", nh))
        rep = nh // nkv
        q, y = bufs[t.inputs[0]], bufs[t.outputs[0]]
        flat = q.cols == nh * hd and y.cols == nh * hd
        groups = nkv if flat else 1
        # a batch: tasks per group of sequences too, each writing its rows of sequence-major
        # partials [1, B*nh*(hd+2)] (regions.py), so B x G x P tasks spread over the SMs
        B = 1 if opts.target.whole_ops or not flat else _batch(t, bufs, nh, hd)
        per = sequences_per_task(B, groups, opts)
        seqs = [{"b_off": b, "b_count": per} for b in range(0, B, per)] if B > 1 else [{}]
        start = int(p.get("kv_start", 0))
        length = int(p.get("kv_len", bufs[t.inputs[1]].shape[-3] - start))
        P = shard_count(length, groups * len(seqs), opts)
        one = B == 1 and not opts.combine_per_group     # one combine, folded into its readers
        if (one and opts.fold_partial_bytes and opts.attn_splits is None
                and not fold_fits(nh, hd, P, opts)):
            one = False
        pos = t.inputs[3] if len(t.inputs) > 3 else None
        # the live count needs the runtime pos (and more than one shard); a static window's P
        # is already its count
        rows = shard_rows(opts) if pos is not None and P > 1 else 0
        live = {"kv_shard_rows": rows} if rows else {}
        if P == 1 and B == 1 and (groups == 1 or opts.target.whole_ops):
            out.append(t)
            continue
        changed = True
        heads = [{"h_off": g * rep, "h_count": rep} for g in range(groups)] if flat else [{}]
        if P == 1:
            # one shard a sequence: each task writes its heads of its sequences' rows of y
            # (regions.py: a row a sequence), no partial and no combine
            for sq in seqs:
                where = f"seq {sq['b_off']}+{per} " if sq else ""
                out += [Task(t.id, t.op, t.inputs, t.outputs, {**p, **sq, **h}, t.waits,
                             t.out_counter, f"{t.name}[{where}kv {g}/{groups}]")
                        for g, h in enumerate(heads)]
            continue
        parts = []
        shape = (1, B * nh * (hd + 2)) if B > 1 else tuple(q.shape[:-1]) + (nh * (hd + 2),)
        for s in range(P):
            b = Buffer(len(bufs), f"{y.name}.part{s}", BufferKind.ACTIVATION, DType.F32, shape)
            bufs.append(b)
            parts.append(b.id)
        for sq in seqs:
            where = f"seq {sq['b_off']}+{per} " if sq else ""
            for g, h in enumerate(heads):
                for s in range(P):
                    sp = {**p, **sq, **h, "kv_start": start, "kv_len": length, "kv_shard": s,
                          "kv_shards": P, **live, "flags": int(p.get("flags", 0)) | PARTIAL_WRITE}
                    out.append(Task(t.id, t.op, t.inputs, (parts[s],), sp, t.waits, next_counter,
                                    f"{t.name}[{where}kv {g}/{groups} shard {s}/{P}]"))
        # the combines take the attention's counter, so its consumers' waits stay right. One
        # combine over every head (fuse folds it into each reader) only at batch 1: a batch's
        # fold made each of ~130 o tiles merge every sequence's partials (135 KB of L2 reads
        # a tile at batch 16, 12.7 us: NOTES v24), where one combine a kv group writes y once
        if one:
            heads = [{}]
        comb_in = tuple(parts)
        if live:      # the window the shards split, to count them again (regions.combine_live)
            rows_in_cache = max(0, min(length, bufs[t.inputs[1]].shape[-3] - start))
            live = {**live, "kv_start": start, "kv_len": rows_in_cache,
                    "window": int(p.get("window", 0))}
            comb_in += (pos,)
        for g, h in enumerate(heads):
            cp = {"head_dim": hd, "n_heads": nh, **h, **live}
            out.append(Task(t.id, K.ATTENTION_COMBINE, comb_in, t.outputs, cp,
                            (Wait(next_counter, 1),), t.out_counter,
                            f"{t.name}[combine {g}/{groups}]"))
        next_counter += 1
    if not changed:
        return program
    return rethreshold(program.with_(buffers=tuple(bufs), tasks=tuple(out), queues=()))
