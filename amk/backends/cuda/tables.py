"""Folded program -> the kernel's tables: task descriptors (program tasks first, then FUSED
steps), waits, pointer references, preload and zero ranges, and the variant list codegen turns
into the scheduler's switch. Per-task parameters live in descriptors, so the rendered source
depends only on the set of variants, never on the number of tasks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from amk.gcpause import without_gc
from amk.identity_memo import IdentityMemo
from amk.program.ir import InstructionKind as K, Program
from amk.backends.cuda import abi
from amk.backends.cuda.kernel_spec import KernelSpec, kernel_spec, runs_steps
from amk.backends.cuda.steps import REF_SCRATCH, Encoded, Folded, Variant, View, fail

class _Desc(NamedTuple):
    """One descriptor's scalar fields (TASK_DTYPE's, but ip / fp and the inline waits)."""
    op: int
    variant: int
    ptr_begin: int
    n_in: int
    n_out: int
    task_id: int
    n_ptr_all: int
    wait_begin: int = 0
    n_waits: int = 0
    out_counter: int = -1
    sub_begin: int = 0
    n_sub: int = 0
    pre_begin: int = 0
    zero_begin: int = 0
    n_zero: int = 0
    n_pre: int = 0


_FIELDS = _Desc._fields


@dataclass
class Lowered:
    spec: KernelSpec                     # what kernel.cu depends on (its variants: the switch)
    tasks: np.ndarray                    # TASK_DTYPE, program tasks first then FUSED steps
    n_program_tasks: int
    waits: np.ndarray                    # WAIT_DTYPE
    ptr_refs: np.ndarray                 # int64 [n, 2]: (kind, buffer id | scratch offset)
    ranges: list[tuple[tuple[int, int], int, int]]   # (ref, byte offset, bytes): preload, zero
    scratch_bytes: int
    queues: list[list[int]]              # per-CTA task ids (program order within a queue)

    @property
    def variants(self) -> tuple[Variant, ...]:
        return self.spec.variants


@without_gc
def pack(program: Program, folded: Folded, spec: KernelSpec | None = None) -> Lowered:
    """The descriptor arrays of the folded program; spec: kernel_spec(folded), when the caller
    has it already (its variant numbers are the descriptors')."""
    spec = kernel_spec(folded) if spec is None else spec
    n_inc = np.zeros(len(program.counters), dtype=np.int64)
    for t in program.tasks:
        if t.out_counter is not None and t.out_counter >= 0:
            n_inc[t.out_counter] += 1
    # the descriptors: program tasks, then the FUSED tasks' steps; and each one's encoded
    # content (its ip / fp slots)
    rows: list[_Desc] = []
    subs: list[_Desc] = []
    contents: list[tuple] = []
    sub_contents: list[tuple] = []
    encs = _Encodings(spec.encoded)
    waits: list[tuple[int, int, int]] = []
    refs: list[int] = []                  # (kind, id | offset) pairs, flat: one array at the end
    ranges: list[tuple[tuple[int, int], int, int]] = []

    def pointers(ins: list[View], outs: list[View]) -> int:
        begin = len(refs) // 2
        for v in ins:
            refs.extend(v.ref)
        for v in outs:
            refs.extend(v.ref)
        return begin

    n_prog, n_counters = len(folded.tasks), len(program.counters)
    for ft in folded.tasks:
        t = ft.task
        wait_begin = len(waits)
        for w in t.waits:
            if not 0 <= w.counter < n_counters:
                fail(t, f"waits on counter {w.counter}, which does not exist")
            waits.append((w.counter, w.threshold, int(n_inc[w.counter])))
        out_counter = t.out_counter if t.out_counter is not None else -1
        if runs_steps(ft):
            c = encs.of(_FUSED_ENC)
            ptr_begin = pointers(ft.ins, ft.outs)
            sub_begin, zero_begin = n_prog + len(subs), len(ranges)
            ranges.extend(((REF_SCRATCH, o), 0, n) for o, n in ft.zero)
            for enc, sins, souts in ft.steps:
                e = encs.of(enc)
                sub_contents.append(e)
                subs.append(_Desc(e[0], e[1], pointers(sins, souts), len(sins), len(souts), t.id, 0))
            rows.append(_Desc(c[0], c[1], ptr_begin, len(ft.ins), len(ft.outs), t.id,
                              len(refs) // 2 - ptr_begin,     # its own pointers, then its steps'
                              wait_begin, len(t.waits), out_counter, sub_begin=sub_begin,
                              n_sub=len(ft.steps), zero_begin=zero_begin, n_zero=len(ft.zero)))
        else:
            enc, sins, souts = ft.steps[0]
            c = encs.of(enc)
            n_in, n_out = len(sins), len(souts)
            rows.append(_Desc(c[0], c[1], pointers(sins, souts), n_in, n_out, t.id, n_in + n_out,
                              wait_begin, len(t.waits), out_counter))
        contents.append(c)

    pre: dict[int, tuple[int, int]] = {}
    for q in folded.queues:       # each preload's ranges go to the task before it in its queue
        for k, j in enumerate(q):
            if k > 0 and folded.tasks[j].preload:
                pre[q[k - 1]] = (len(ranges), len(folded.tasks[j].preload))
                ranges.extend(folded.tasks[j].preload)
    table = _table(rows + subs, contents + sub_contents, pre, waits)
    wt = np.zeros(len(waits), dtype=abi.WAIT_DTYPE)
    if waits:
        wt["counter"], wt["threshold"], wt["stride"] = _columns(
            [(c, th & 0xFFFFFFFF, st) for c, th, st in waits], 3)
    return Lowered(spec=spec, tasks=table,
                   n_program_tasks=n_prog, waits=wt,
                   ptr_refs=np.array(refs, dtype=np.int64).reshape(-1, 2),
                   ranges=ranges, scratch_bytes=folded.scratch_bytes, queues=folded.queues)


_FUSED_ENC = Encoded(int(K.FUSED), None)      # a FUSED task's own descriptor: its steps run


class _Encodings:
    """Each Encoded's descriptor content, once per object (the tasks of a kind share theirs):
    (op, variant index, ip (slots, values), fp (slots, values)). Variants are numbered as the
    kernel spec lists them (the order the descriptors first name them)."""

    def __init__(self, encoded: tuple[Variant, ...]):
        self._variants = {v: i for i, v in enumerate(encoded)}
        self._memo = IdentityMemo()

    def of(self, enc: Encoded) -> tuple:
        return self._memo.get(enc, None, lambda: self._content(enc))

    def _content(self, enc: Encoded) -> tuple:
        var = -1 if enc.variant is None else self._variants[enc.variant]
        g = enc.group
        # the slot index of each name (a name the group lacks raises), values cast as they go
        ip = ([abi.ip_index(g, n) for n in enc.ip], [int(v) for v in enc.ip.values()])
        fp = ([abi.fp_index(g, n) for n in enc.fp], [float(v) for v in enc.fp.values()])
        return enc.op, var, ip, fp


def _columns(rows: list, n: int) -> list[list]:
    return [list(col) for col in zip(*rows)] if rows else [[] for _ in range(n)]


def _table(descs: list[_Desc], contents: list[tuple], pre: dict[int, tuple[int, int]],
           waits: list[tuple[int, int, int]]) -> np.ndarray:
    """The TASK_DTYPE array of the descriptors (pre: a row's pre_begin, n_pre), filled a column at a time (a record at a time cost ~1 s for 10^4 tasks)."""
    n = len(descs)
    table = np.zeros(n, dtype=abi.TASK_DTYPE)
    if not n:
        return table
    columns = dict(zip(_FIELDS, map(list, zip(*descs))))
    for i, (begin, count) in pre.items():
        columns["pre_begin"][i], columns["n_pre"][i] = begin, count
    for f in _FIELDS:
        table[f] = columns[f]
    # each field's own dtype, so an out-of-range value raises as a record assignment does
    ip, fp, wc, wt, ws = (np.zeros((n,) + table.dtype[f].shape, table.dtype[f].base)
                          for f in ("ip", "fp", "wait_c", "wait_t", "wait_s"))
    # the parameters as (row, slot, value) triples, then one assignment a table
    for k, table_of in ((2, ip), (3, fp)):
        at_rows: list[int] = []
        at: list[int] = []
        vals: list = []
        for i, c in enumerate(contents):
            slots, values = c[k]
            if slots:
                at_rows += [i] * len(slots)
                at += slots
                vals += values
        # np.array of Python numbers in the field's dtype: an out-of-range value still raises
        table_of[at_rows, at] = np.array(vals, dtype=table_of.dtype)
    for i, (b, nw) in enumerate(zip(columns["wait_begin"], columns["n_waits"])):
        for k, (c, th, st) in enumerate(waits[b:b + min(nw, abi.INLINE_WAITS)]):
            wc[i, k], wt[i, k], ws[i, k] = c, th & 0xFFFFFFFF, st   # polled from smem
    table["ip"], table["fp"] = ip, fp
    table["wait_c"], table["wait_t"], table["wait_s"] = wc, wt, ws
    return table
