"""Where a prompt chunk's GPU time goes on the triton backend: each task of one chunk program
(Llama-3.2-1B shape, random bf16 weights, --rows rows at positions --start..) launched alone
and timed with CUDA events, summed by opcode and by the heaviest task shapes.

    python bench/prefill_chunk.py --rows 512 --start 488
    python bench/prefill_chunk.py --model qwen3-0.6b --rows 512
"""
from __future__ import annotations

import collections
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH
from gpu_tool import have_gpu, parser  # noqa: E402


def task_times(exe, iters: int) -> list[float]:
    """ms of each task of a TritonProgram whose bindings are in place (mean of iters launches)."""
    out = []
    for task in exe.program.tasks:
        exe._launch(task, exe._slots)                  # warm (compiled by the first run already)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            exe._launch(task, exe._slots)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / iters)
    return out


def main() -> None:
    ap = parser(__doc__)
    from amk.models.presets import PRESETS
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--start", type=int, default=488, help="position of the chunk's first row")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not have_gpu(__file__):
        sys.exit(2)
    from amk.models.prefill import Chunk, chunk_args
    from amk.models.presets import random_model
    cfg = replace(PRESETS[a.model], max_seq=a.start + a.rows + 256, dtype=torch.bfloat16)
    m = random_model(cfg, device="cuda")
    step = m.prefill_jit("triton")
    args = chunk_args(m, Chunk(a.start, a.rows, a.rows), m.new_kv())
    step(*args)                                        # compile, capture
    exe, bindings = step.executable(*args)
    exe._bind(bindings)
    times = task_times(exe, a.iters)
    by_op, by_shape = collections.Counter(), collections.Counter()
    for task, ms in zip(exe.program.tasks, times):
        by_op[task.op.name] += ms
        shapes = " ".join(str(tuple(exe.program.buffers[b].shape)) for b in task.inputs[:2])
        by_shape[f"{task.op.name} {shapes}"] += ms
    row = {"model": a.model, "rows": a.rows, "start": a.start, "tasks": len(times),
           "sum_of_tasks_ms": sum(times),
           "graph_replay_ms": _replay_ms(exe),
           "by_op_ms": {k: round(v, 3) for k, v in by_op.most_common()},
           "top_shapes_ms": {k: round(v, 3) for k, v in by_shape.most_common(12)}}
    print(json.dumps(row, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=1))


def _replay_ms(exe) -> float:
    from decode import time_ms
    return time_ms(exe.replay, iters=5)


if __name__ == "__main__":
    main()
