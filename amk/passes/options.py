"""Pass options: the target machine and every knob the passes read, as plain frozen data.

Tests and benchmarks sweep these (tile sizes, split counts, fusion on/off); a pass never reads
the environment. `None` for a size means "derive it from the target" (each pass documents how).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Target:
    """What the schedule is shaped for. Bandwidth and flops are per whole device."""
    name: str
    num_sms: int                    # persistent workers = static queues
    smem_bytes: int                 # shared memory per SM
    mem_bw: float = 3.96e12         # bytes/s a large read streams at (measured on H200)
    flops: float = 989e12           # dense bf16 flop/s
    max_tile_bytes: int = 256 << 10  # weight bytes a GEMV tile streams at most (see tile.py)
    min_tile_cols: int = 16         # tile widths are multiples of this (one MMA/warp row block)
    task_overhead_ns: float = 1500.0  # counter wait + dispatch + activation reads per task (H200, measured 2026: several us)
    # Each task is one kernel launch whose grid spreads the op over the device (the triton
    # backend): tile and split_kv keep every op whole (no column tiles, no kv-group tasks).
    whole_ops: bool = False

    def with_(self, **kw) -> "Target":
        return replace(self, **kw)


# GPUs: GEMV tiles up to 4 MiB, multiples of 8 rows (one tile per SM per stage, bench/NOTES v9)
H200 = Target("H200", num_sms=132, smem_bytes=227 << 10, mem_bw=3.96e12, flops=989e12,
              max_tile_bytes=4 << 20, min_tile_cols=8)
H100 = Target("H100", num_sms=132, smem_bytes=227 << 10, mem_bw=3.0e12, flops=989e12,
              max_tile_bytes=4 << 20, min_tile_cols=8)
# A few workers with big tiles: what the reference VM and tests on a CPU want (few tasks).
CPU = Target("CPU", num_sms=4, smem_bytes=1 << 20, mem_bw=50e9, flops=200e9,
             max_tile_bytes=1 << 20, task_overhead_ns=2000.0)

# One kernel launch per task (the triton backend): one worker, whole-op tasks, no tiling; each
# launch spreads over the GPU by itself, so splitting an op would only add launches.
LAUNCH = Target("LAUNCH", num_sms=1, smem_bytes=227 << 10, max_tile_bytes=1 << 62,
                task_overhead_ns=3000.0, whole_ops=True)

TARGETS = {t.name: t for t in (H200, H100, CPU, LAUNCH)}

# Producer -> consumer chains `fuse` folds, by the op of each task's final step (FUSED tasks
# match by the op that writes their output). See amk/passes/fuse.py.
DEFAULT_FUSE_RULES: tuple[tuple[str, str], ...] = (
    ("RMSNORM", "GEMV_TILE"), ("RMSNORM", "GEMM_TILE"),
    ("LAYERNORM", "GEMV_TILE"), ("LAYERNORM", "GEMM_TILE"),
    ("GEMV_TILE", "ADD"), ("GEMM_TILE", "ADD"), ("SUM", "ADD"),
    ("GEMV_TILE", "SILU_MUL"), ("GEMM_TILE", "SILU_MUL"),
    ("GEMV_TILE", "ROPE"), ("GEMM_TILE", "ROPE"),
    ("GEMV_TILE", "KV_APPEND"), ("GEMM_TILE", "KV_APPEND"),
    ("ROPE", "KV_APPEND"), ("ROPE", "ATTENTION_TILE"),
    # a q/k norm (Qwen3, Gemma 3, OLMo 2) into the rope after it, and so into every attention
    # and append that rotates: no stage of its own between the projections and the attention
    ("RMSNORM", "ROPE"),
)

# One whole-output combine folded into every GEMV tile that reads it (each tile merges the
# partials itself, ~70 KB of L2 reads for Llama-3.2-1B, instead of a task hand-off).
COMBINE_INTO_GEMV: tuple[tuple[str, str], ...] = (
    ("ATTENTION_COMBINE", "GEMV_TILE"), ("ATTENTION_COMBINE", "GEMM_TILE"))


@dataclass(frozen=True)
class PassOptions:
    target: Target = H200
    tile_n: int | None = None         # GEMV/GEMM output columns per tile; None = from target
    k_split: int | None = None        # K slices of a batched GEMV (tile.split_k); None = from
    #                                   the target's bytes, 1 = never
    attn_splits: int | None = None    # split-KV shards P per head group; None = from target
    kv_shard_min: int = 128           # derived P never makes shards shorter than this
    combine_per_group: bool = True    # split_kv: one ATTENTION_COMBINE per kv group (else one)
    # split_kv at batch 1: one combine over every head (its readers fold it in) only where a
    # reader's x (f32, 1024-aligned) and all of P's partials fit in this many bytes, so that it
    # stages them in one round trip (the cuda backend's shared memory below the o tile's
    # preload); else one combine a kv group. None: always the one combine
    fold_partial_bytes: int | None = None
    # split_kv: a derived P at most this (the cuda backend: a task's operand limit less the
    # combine's pos and output and those of the o tile it may be folded into); None: no bound
    max_kv_shards: int | None = None
    defer_kv_append: bool = False     # the attention reads the new K/V row; the append runs after
    fuse: bool = True
    fuse_rules: tuple[tuple[str, str], ...] | None = None   # None = DEFAULT_FUSE_RULES
    plan_memory: bool = True
    place: bool = True
    extra: tuple[tuple[str, object], ...] = field(default=())  # free-form, for experiments

    def with_(self, **kw) -> "PassOptions":
        return replace(self, **kw)

    @property
    def rules(self) -> tuple[tuple[str, str], ...]:
        return DEFAULT_FUSE_RULES if self.fuse_rules is None else tuple(self.fuse_rules)

    @staticmethod
    def for_backend(backend: str, device=None) -> "PassOptions":
        """Defaults for a backend: a GPU target shaped like the device for cuda; whole-op,
        unfused tasks for triton (a FUSED recipe there is the same launches plus scratch); CPU
        otherwise."""
        if backend == "cuda":      # batch 1's combine recomputed by each o-projection tile where
            # that pays (split_kv): no hop; the attention waits for the k/v projections, not for
            # the cache appends
            from amk.backends.cuda.abi import MAX_PTRS
            from amk.backends.cuda.smem import FOLD_STAGE_TOP
            return PassOptions(target=gpu_target(device), combine_per_group=False,
                               fold_partial_bytes=FOLD_STAGE_TOP, max_kv_shards=MAX_PTRS - 8,
                               defer_kv_append=True,
                               fuse_rules=DEFAULT_FUSE_RULES + COMBINE_INTO_GEMV)
        if backend == "triton":
            return PassOptions(target=LAUNCH, fuse=False)
        return PassOptions(target=CPU)


def gpu_target(device=None) -> Target:
    """The preset matching the CUDA device's name, with its real SM count (one persistent CTA
    and one queue per SM) and smem."""
    try:
        import torch
        if not torch.cuda.is_available():
            return H200
        props = torch.cuda.get_device_properties(device if device is not None else 0)
    except Exception:  # no driver: shape for the default target
        return H200
    base = H100 if "H100" in props.name else H200
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or base.smem_bytes)
    return base.with_(name=props.name, num_sms=int(props.multi_processor_count), smem_bytes=smem)
