"""The host/device ABI of the CUDA megakernel, written once in Python.

The C++ header (opcodes, dtype codes, the task-descriptor struct, per-opcode parameter slots) is
GENERATED from this module and from the enums in amk/program/ir.py; the host packs descriptors
with numpy dtypes built from the same field lists. Nothing here is written twice.
"""
from __future__ import annotations

import numpy as np

from amk.program.ir import DType, InstructionKind

# The task descriptor: one per task and one per FUSED step (a "sub-task").
# (name, C type, count). Every field is 4 bytes, so C and numpy agree on the layout without padding.
MAX_PTRS = 64      # operands one descriptor may have (a split-KV combine has P + 1)
N_IP = 24          # integer parameter slots (a descriptor stays a multiple of 16 bytes)
N_FP = 4           # float parameter slots
INLINE_WAITS = 4         # waits a TaskDesc carries itself (more: read from the waits table)
TASK_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("op", "int", 1),            # InstructionKind
    ("variant", "int", 1),       # which rendered device function runs it (codegen's switch)
    ("wait_begin", "int", 1),    # waits[wait_begin : wait_begin+n_waits]
    ("n_waits", "int", 1),
    ("out_counter", "int", 1),   # -1: none
    ("ptr_begin", "int", 1),     # ptrs[ptr_begin : +n_in+n_out], inputs first
    ("n_in", "int", 1),
    ("n_out", "int", 1),
    ("sub_begin", "int", 1),     # FUSED: sub-task descriptors tasks[sub_begin : +n_sub]
    ("n_sub", "int", 1),
    ("pre_begin", "int", 1),     # the NEXT task's preload: ranges[pre_begin : +n_pre]
    ("zero_begin", "int", 1),    # FUSED: scratch ranges zeroed before the steps run
    ("n_zero", "int", 1),
    ("task_id", "int", 1),       # Program task id (for error reports)
    ("n_ptr_all", "int", 1),     # pointers of the task AND its FUSED steps, contiguous from
                                 #   ptr_begin (the scheduler copies them in one go)
    ("n_pre", "int", 1),         # copied into smem at AMK_PRE_OFF during this task (preload.py)
    ("wait_c", "int", INLINE_WAITS),          # the first INLINE_WAITS waits again (counter,
    ("wait_t", "unsigned", INLINE_WAITS),     #   threshold, stride): they arrive in shared memory
    ("wait_s", "unsigned", INLINE_WAITS),     #   with the descriptor, no load before the poll
    ("ip", "int", N_IP),
    ("fp", "float", N_FP),
)
WAIT_FIELDS = (("counter", "int", 1), ("threshold", "unsigned", 1), ("stride", "unsigned", 1),
               ("pad", "int", 1))
RANGE_FIELDS = (("addr", "unsigned long long", 1), ("bytes", "unsigned long long", 1))
ERR_FIELDS = (("task", "int", 1), ("counter", "int", 1), ("value", "unsigned", 1),
              ("target", "unsigned", 1))
# Kernel-wide state, persistent across launches: the epoch (completed steps) lives here so the
# kernel advances it itself and nothing runs on the host between steps.
STATE_FIELDS = (("epoch", "unsigned", 1), ("done", "unsigned", 1), ("abort", "unsigned", 1),
                ("fault", "int", 1), ("fault_task", "int", 1), ("fault_value", "int", 1),
                ("pad0", "int", 1), ("pad1", "int", 1))

FAULT_DEADLOCK = 1
FAULT_KV_POS = 2        # KV_APPEND position outside the cache
FAULT_EMBED_ID = 3      # token id outside the embedding table
FAULT_COPY = 4          # a bulk copy into smem never completed (templates/common.cuh, mbar_wait)
# AMK_PROFILE, per queue entry (u64 words): wait start, wait end, end, SM, ready (the post-wait
# barrier passed: the task's descriptor copies landed), then PROF_STEPS FUSED step starts, then
# PROF_MARKS AMK_MARK points for each of PROF_STEPS steps (a plain task's are step 0's).
PROF_HEAD = 5
PROF_STEPS = 8
PROF_MARKS = 10
PROF_MARK0 = PROF_HEAD + PROF_STEPS
PROF_WORDS = PROF_MARK0 + PROF_STEPS * PROF_MARKS

_NP = {"int": np.int32, "unsigned": np.uint32, "float": np.float32,
       "unsigned long long": np.uint64}


def np_dtype(fields) -> np.dtype:
    return np.dtype([(n, _NP[t], (c,)) if c > 1 else (n, _NP[t]) for n, t, c in fields])


TASK_DTYPE = np_dtype(TASK_FIELDS)
WAIT_DTYPE = np_dtype(WAIT_FIELDS)
RANGE_DTYPE = np_dtype(RANGE_FIELDS)
ERR_DTYPE = np_dtype(ERR_FIELDS)
STATE_DTYPE = np_dtype(STATE_FIELDS)

# Per-opcode parameter slots: name -> index into ip[] (ints) / fp[] (floats). The device code
# reads d.ip[P_<GROUP>_<NAME>]; the encoder writes by name. Opcodes sharing a kernel share a group.
IP_SLOTS: dict[str, tuple[str, ...]] = {
    "EW": ("ROWS", "COLS", "C0", "C1", "A_RS", "A_CS", "B_RS", "B_CS", "KIND"),
    # XS_READY: x is already in shared memory as fp32 (a fused norm put it there: TO_SMEM)
    # ARG_SLOT: op_gemv_direct EPI 3 writes its tile's argmax partial to slot ARG_SLOT of its
    # second output (argmax_fold.py)
    # PRE: op_gemv_direct's first PRE rows of each matrix are in smem at AMK_PRE_OFF (preload.py)
    # fp EPS: the RMSNorm op_gemv_direct runs itself (NORM, folds.norm_into_gemv)
    # BIAS_AT: the bias input's index (0: none; a quantized GEMV's bias is its last input)
    # KW, SPI, RD: op_gemv_mma's x window (elements of K), K segments an item and the stages
    # of each warp's weight ring (gemv_batch.py);
    # ARG_SLOTS: its EPI 3 partials a row of x (the argmax's tiles)
    # GSHIFT: op_gemv_qdirect's group index is k >> GSHIFT (clamped to the last group)
    "GEMV": ("M", "K", "N", "N_OFF", "N_TILE", "LDW", "GROUP", "NGROUPS", "XS_READY", "ARG_SLOT",
             "PRE", "BIAS_AT", "KW", "SPI", "ARG_SLOTS", "GSHIFT",
             "RD", "KLO", "KHI"),     # KLO, KHI: op_gemv_mma KS's K slice [KLO, KHI) of K
    "NORM": ("ROWS", "H", "TO_SMEM"),
    "ROPE": ("ROWS", "COLS", "C0", "C1", "HD", "NPOS", "POS64", "HAS_INV"),
    # Q_ROPE: q is rotated here (folds.rope_into_attention); K_ROPE: so is NEW_KV's new k row
    # (folds.k_rope_into_attention); inverse frequencies at the last input when ROPE_INV, else
    # from THETA. NEW_KV: cache row pos is read from k_new, v_new (P[4], P[5]). KV_SHARD of
    # KV_SHARDS: the shard's piece of the live window (regions.kv_window), SHARD_ROWS > 0: of
    # the live shards only (regions.live_shards). Sequences [B_OFF, B_OFF + B_COUNT) of the
    # cache's (regions.seq_range); POS_SEQ: sequence b at pos[b], else every one at pos[0]
    "ATTN": ("HD", "NH", "NKV", "KV_START", "KV_LEN", "FLAGS", "H_OFF", "H_COUNT", "B_OFF",
             "B_COUNT", "POS_SEQ", "MAX_SEQ", "POS64", "HAS_POS", "Q_ROPE",
             "ROPE_INV", "NEW_KV", "K_ROPE",
             "KV_SHARD", "KV_SHARDS", "WINDOW",    # WINDOW > 0: rows (pos - WINDOW, pos] only
             "SHARD_ROWS",
             "QKN_ARGS",    # q's norm weight at input QKN_ARGS & 255, the new k row's at >> 8
                            # (0: none; folds.norm_into_attention), eps QKN_EPS
             "EARLY"),      # pos read and the K/V copies issued during the poll (attn_early)
    # op_ewx (templates/ops_models.cuh): unary ops and COPY's column move; x read at
    # r * A_RS + c + A_SHIFT for output (r, c), c in [C0, C1)
    "EWX": ("ROWS", "COLS", "C0", "C1", "A_RS", "A_SHIFT", "XKIND"),
    # SHARD_ROWS > 0: only the live shards' partials (regions.combine_live), counted from
    # KV_START, KV_LEN, WINDOW and pos, the input after the partials (POS_SEQ: row b's at pos[b])
    "COMB": ("HD", "NH", "H_OFF", "H_COUNT", "B", "P", "TO_SMEM", "SHARD_ROWS", "KV_START",
             "KV_LEN", "WINDOW", "POS64", "POS_SEQ"),
    "EMBED": ("B", "H", "V", "IDS64"),
    # ROPE_HD > 0: the new rows are rotated here (folds.rope_into_append), inverse frequencies
    # at P[2] when ROPE_INV, else from THETA; POS_SEQ: sequence b's rows at pos[b]
    "KV": ("ROWLEN", "NROWS", "MAX_SEQ", "B", "POS64", "HAS_POS", "POS_PARAM", "ROPE_HD", "ROPE_INV",
           "POS_SEQ"),
    "ARGMAX": ("ROWS", "V", "OUT64"),
    "SOFTMAX": ("ROWS", "H"),
    "DEQ": ("N", "K", "LDQ", "GROUP", "NGROUPS", "PACKED"),
    # op_sum (templates/ops_simple.cuh; SUM and ALLREDUCE_SHARD): out (r, c) for c in [C0, C1)
    # of ROWS x COLS
    "SUM": ("ROWS", "COLS", "C0", "C1"),
}
FP_SLOTS: dict[str, tuple[str, ...]] = {
    "EW": ("SCALE",), "NORM": ("EPS",), "GEMV": ("EPS",), "ROPE": ("THETA",), "KV": ("THETA",),
    "ATTN": ("SCALE", "THETA", "SOFTCAP",        # SOFTCAP > 0: scores -> SOFTCAP tanh(s / SOFTCAP)
             "QKN_EPS"),                  # both folded norms' eps (folds.norm_into_attention)
    "EWX": ("CAP",),
}
EW_KINDS = ("COPY", "ADD", "MUL", "MULS", "SILU_MUL", "GELU")
EWX_KINDS = ("COPY_COLS", "SOFTCAP", "GELU_TANH")      # op_ewx's kinds

for _g, _names in IP_SLOTS.items():
    assert len(_names) <= N_IP, _g
for _g, _names in FP_SLOTS.items():
    assert len(_names) <= N_FP, _g


def ip_index(group: str, name: str) -> int:
    return IP_SLOTS[group].index(name)


def fp_index(group: str, name: str) -> int:
    return FP_SLOTS[group].index(name)


def _struct(name: str, fields) -> str:
    body = "".join(f"  {t} {n}{f'[{c}]' if c > 1 else ''};\n" for n, t, c in fields)
    size = np_dtype(fields).itemsize
    return (f"struct {name} {{\n{body}}};\n"
            f"static_assert(sizeof({name}) == {size}, \"{name} layout drifted from abi.py\");\n")


def render_header() -> str:
    """The generated ABI header (prepended to every rendered source)."""
    out = ["// ---- generated by amk/backends/cuda/abi.py: do not edit ----\n"]
    out += [f"#define OP_{k.name} {int(k)}\n" for k in InstructionKind]
    out += [f"#define DT_{d.name} {int(d)}\n" for d in DType]
    out += [f"#define EW_{k} {i}\n" for i, k in enumerate(EW_KINDS)]
    out += [f"#define EWX_{k} {i}\n" for i, k in enumerate(EWX_KINDS)]
    out += [f"#define FAULT_DEADLOCK {FAULT_DEADLOCK}\n", f"#define FAULT_KV_POS {FAULT_KV_POS}\n",
            f"#define FAULT_EMBED_ID {FAULT_EMBED_ID}\n", f"#define FAULT_COPY {FAULT_COPY}\n",
            f"#define AMK_INLINE_WAITS {INLINE_WAITS}\n"]
    for g, names in IP_SLOTS.items():
        out += [f"#define P_{g}_{n} {i}\n" for i, n in enumerate(names)]
    for g, names in FP_SLOTS.items():
        out += [f"#define F_{g}_{n} {i}\n" for i, n in enumerate(names)]
    out.append(_struct("TaskDesc", TASK_FIELDS))
    out.append(_struct("WaitDesc", WAIT_FIELDS))
    out.append(_struct("RangeDesc", RANGE_FIELDS))
    out.append(_struct("ErrSlot", ERR_FIELDS))
    out.append(_struct("KernelState", STATE_FIELDS))
    out.append(_struct("KernelArgs", ARGS_FIELDS))
    return "".join(out)

# The kernel's one by-value parameter: device addresses of the tables, and scalars.
ARGS_FIELDS = (("tasks", "unsigned long long", 1), ("waits", "unsigned long long", 1),
               ("ptrs", "unsigned long long", 1), ("ranges", "unsigned long long", 1),
               ("queue_tasks", "unsigned long long", 1), ("queue_off", "unsigned long long", 1),
               ("counters", "unsigned long long", 1), ("state", "unsigned long long", 1),
               ("errs", "unsigned long long", 1), ("watchdog_ns", "unsigned long long", 1),
               ("n_queues", "unsigned long long", 1),
               ("prof", "unsigned long long", 1))        # AMK_PROFILE: u64 [queue entries][PROF_WORDS]
ARGS_DTYPE = np_dtype(ARGS_FIELDS)

# The ip/fp slot group each opcode's descriptor uses (what the encoders write; for printing).
OP_GROUP = {InstructionKind.COPY: "EW", InstructionKind.ADD: "EW", InstructionKind.MUL: "EW",
            InstructionKind.SILU_MUL: "EW", InstructionKind.GELU: "EW",
            InstructionKind.ALLREDUCE_SHARD: "SUM", InstructionKind.GEMV_TILE: "GEMV",
            InstructionKind.GEMM_TILE: "GEMV", InstructionKind.RMSNORM: "NORM",
            InstructionKind.LAYERNORM: "NORM", InstructionKind.ROPE: "ROPE",
            InstructionKind.ATTENTION_TILE: "ATTN", InstructionKind.ATTENTION_COMBINE: "COMB",
            InstructionKind.EMBED: "EMBED", InstructionKind.KV_APPEND: "KV",
            InstructionKind.SAMPLE_ARGMAX: "ARGMAX", InstructionKind.SOFTMAX: "SOFTMAX",
            InstructionKind.DEQUANT: "DEQ", InstructionKind.SUM: "SUM"}
