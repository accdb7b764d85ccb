"""One plain (not graph-captured) launch of a preset shape's decode megakernel (--model, --max-seq), for
Nsight Compute: warm steps first, then `--steps` more, each a single `amk_megakernel` launch.
Set AMK_LINEINFO=1 so ncu's source page maps SASS to lines of the generated kernel, and
AMK_DUMP_IR=DIR to keep that kernel.cu.

    AMK_LINEINFO=1 ncu --set full -k amk_megakernel --launch-skip 3 --launch-count 1 \\
        -o step python bench/profile/ncu_step.py --context 1024
    ncu -i step.ncu-rep --page source --csv --print-source sass > sass.csv

bench/profile/ncu_summary.py folds such a SASS table into time per device function and source line.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # amk and bench without PYTHONPATH

import torch  # noqa: E402

from amk.models.presets import PRESETS  # noqa: E402
from bench.gpu_tool import have_gpu, parser  # noqa: E402
from bench.preset_step import cuda_step  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(PRESETS),
                    help="the preset shape (default %(default)s)")
    ap.add_argument("--max-seq", type=int, default=8192, help="KV cache rows (default %(default)s)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5, help="launches after 3 warm ones")
    a = ap.parse_args(argv)
    if not have_gpu(__file__):
        return 2
    step, args, _ = cuda_step(a.context, a.layers, a.model, a.max_seq)
    exe, bindings = step.executable(*args)
    for _ in range(3 + a.steps):
        exe.run(bindings)
    torch.cuda.synchronize()
    print(f"context {a.context}: {3 + a.steps} launches, {exe.kernel.num_regs} registers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
