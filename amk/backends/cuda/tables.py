"""Folded program -> the kernel's tables: task descriptors (program tasks first, then FUSED
steps), waits, pointer references, preload and zero ranges, and the variant list codegen turns
into the scheduler's switch. Per-task parameters live in descriptors, so the rendered source
depends only on the set of variants, never on the number of tasks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from amk.gcpause import without_gc
from amk.identity_memo import IdentityMemo
from amk.program.ir import InstructionKind as K, Program
from amk.backends.cuda import abi
from amk.backends.cuda.steps import REF_SCRATCH, Encoded, Folded, Variant, View, fail

_FIELDS = ("op", "variant", "wait_begin", "n_waits", "out_counter", "ptr_begin", "n_in", "n_out",
           "sub_begin", "n_sub", "pre_begin", "zero_begin", "n_zero", "task_id", "n_ptr_all",
           "n_pre")


@dataclass
class Lowered:
    variants: list[Variant]
    tasks: np.ndarray                    # TASK_DTYPE, program tasks first then FUSED steps
    n_program_tasks: int
    waits: np.ndarray                    # WAIT_DTYPE
    ptr_refs: np.ndarray                 # int64 [n, 2]: (kind, buffer id | scratch offset)
    ranges: list[tuple[tuple[int, int], int, int]]   # (ref, byte offset, bytes): preload, zero
    scratch_bytes: int
    queues: list[list[int]]              # per-CTA task ids (program order within a queue)


@without_gc
def pack(program: Program, folded: Folded) -> Lowered:
    variants: dict[Variant, int] = {}
    n_inc = np.zeros(len(program.counters), dtype=np.int64)
    for t in program.tasks:
        if t.out_counter is not None and t.out_counter >= 0:
            n_inc[t.out_counter] += 1
    rows: list[dict[str, Any]] = []
    subs: list[dict[str, Any]] = []
    waits: list[tuple[int, int, int]] = []
    refs: list[int] = []                  # (kind, id | offset) pairs, flat: one array at the end
    ranges: list[tuple[tuple[int, int], int, int]] = []

    def desc(enc: Encoded, ins: list[View], outs: list[View]) -> dict[str, Any]:
        var = -1 if enc.variant is None else variants.setdefault(enc.variant, len(variants))
        d = dict(op=enc.op, variant=var, ptr_begin=len(refs) // 2, n_in=len(ins),
                 n_out=len(outs), ip=enc.ip, fp=enc.fp, group=enc.group)
        for v in ins:
            refs.extend(v.ref)
        for v in outs:
            refs.extend(v.ref)
        return d

    for ft in folded.tasks:
        t = ft.task
        if t.op == K.FUSED and not ft.one:
            d = desc(Encoded(int(t.op), None), ft.ins, ft.outs)
            d["sub_begin"], d["n_sub"] = len(subs), len(ft.steps)
            d["zero_begin"], d["n_zero"] = len(ranges), len(ft.zero)
            ranges.extend(((REF_SCRATCH, o), 0, n) for o, n in ft.zero)
            for enc, sins, souts in ft.steps:
                sd = desc(enc, sins, souts)
                sd["task_id"] = t.id
                subs.append(sd)
            d["n_ptr_all"] = len(refs) // 2 - d["ptr_begin"]  # its steps' pointers follow its own
        else:
            enc, sins, souts = ft.steps[0]
            d = desc(enc, sins, souts)
            d["n_ptr_all"] = d["n_in"] + d["n_out"]
        d["task_id"] = t.id
        d["wait_begin"], d["n_waits"] = len(waits), len(t.waits)
        for w in t.waits:
            if not 0 <= w.counter < len(program.counters):
                fail(t, f"waits on counter {w.counter}, which does not exist")
            waits.append((w.counter, w.threshold, int(n_inc[w.counter])))
        d["out_counter"] = t.out_counter if t.out_counter is not None else -1
        rows.append(d)

    for q in folded.queues:       # each preload's ranges go to the task before it in its queue
        for k, j in enumerate(q):
            if k > 0 and folded.tasks[j].preload:
                d = rows[q[k - 1]]
                d["pre_begin"], d["n_pre"] = len(ranges), len(folded.tasks[j].preload)
                ranges.extend(folded.tasks[j].preload)
    n_prog = len(rows)
    for s in subs:
        s["wait_begin"], s["n_waits"], s["out_counter"] = 0, 0, -1
    for d in rows:
        if d.get("n_sub"):
            d["sub_begin"] += n_prog
    table = _table(rows + subs, waits)
    wt = np.zeros(len(waits), dtype=abi.WAIT_DTYPE)
    if waits:
        wt["counter"], wt["threshold"], wt["stride"] = _columns(
            [(c, th & 0xFFFFFFFF, st) for c, th, st in waits], 3)
    return Lowered(variants=_with_pre(list(variants), table), tasks=table, n_program_tasks=n_prog,
                   waits=wt, ptr_refs=np.array(refs, dtype=np.int64).reshape(-1, 2),
                   ranges=ranges, scratch_bytes=folded.scratch_bytes, queues=folded.queues)


def _columns(rows: list, n: int) -> list[list]:
    return [list(col) for col in zip(*rows)] if rows else [[] for _ in range(n)]


def _table(descs: list[dict[str, Any]], waits: list[tuple[int, int, int]]) -> np.ndarray:
    """The TASK_DTYPE array of the descriptors, filled a column at a time (a record at a time
    cost ~1 s for 10^4 tasks)."""
    table = np.zeros(len(descs), dtype=abi.TASK_DTYPE)
    if not descs:
        return table
    for f in _FIELDS:
        table[f] = [d.get(f, 0) for d in descs]
    # each field's own dtype, so an out-of-range value raises as a record assignment does
    ip, fp, wc, wt, ws = (np.zeros((len(descs),) + table.dtype[f].shape, table.dtype[f].base)
                          for f in ("ip", "fp", "wait_c", "wait_t", "wait_s"))
    # the parameters as (row, slot, value) triples, then one assignment a table; a descriptor's
    # slots and values are memoised by its dict (steps of repeated layers share one)
    rows: dict[str, list] = {"ip": [], "fp": []}
    at: dict[str, list] = {"ip": [], "fp": []}
    vals: dict[str, list] = {"ip": [], "fp": []}
    memo = IdentityMemo()
    for i, d in enumerate(descs):
        g = d["group"]
        for kind, index, cast in (("ip", abi.ip_index, int), ("fp", abi.fp_index, float)):
            params = d[kind]
            if not params:
                continue
            slots, values = memo.get(params, (kind, g), lambda: (
                [index(g, name) for name in params], [cast(v) for v in params.values()]))
            rows[kind] += [i] * len(slots)
            at[kind] += slots
            vals[kind] += values
    for kind, table_of in (("ip", ip), ("fp", fp)):
        # np.array of Python numbers in the field's dtype: an out-of-range value still raises
        table_of[rows[kind], at[kind]] = np.array(vals[kind], dtype=table_of.dtype)
    for i, d in enumerate(descs):
        first = waits[d["wait_begin"]:d["wait_begin"] + min(d["n_waits"], abi.INLINE_WAITS)]
        for k, (c, th, st) in enumerate(first):      # the waits the scheduler polls from smem
            wc[i, k], wt[i, k], ws[i, k] = c, th & 0xFFFFFFFF, st
    table["ip"], table["fp"] = ip, fp
    table["wait_c"], table["wait_t"], table["wait_s"] = wc, wt, ws
    return table


def _with_pre(variants: list[Variant], table: np.ndarray) -> list[Variant]:
    """The preloaded-rows path only in the op_gemv_direct variants some task of which uses it
    (the o tiles after a combine): never-run code in a hot function costs time (NOTES v16)."""
    pre = table["ip"][:, abi.ip_index("GEMV", "PRE")] > 0
    return [v.with_(pre=True) if v.fn == "op_gemv_direct" and pre[table["variant"] == i].any()
            else v for i, v in enumerate(variants)]
