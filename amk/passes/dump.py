"""Stage dumps: one folder per compiled function (AMK_DUMP_IR=DIR), stages printed to stderr
(AMK_PRINT_IR_AFTER, AMK_DEBUG>=3). The edge (amk/jit.py, amk/cli.py) reads those knobs and
passes their values. The same texts are `Lowered.stages`."""
from __future__ import annotations

import sys
from pathlib import Path

_REPRO = '''"""Reproduce: re-parse the final program, validate it and run it on the reference VM with
random inputs. python repro.py"""
import pathlib, sys, torch
from amk.program.text import parse_program
from amk.program.validate import validate
from amk.backends.reference.vm import ReferenceVM
from amk.program.ir import BufferKind

here = pathlib.Path(__file__).parent
prog = parse_program((here / "{final}").read_text())
res = validate(prog)
print(res.report())
if not res.ok:
    sys.exit(1)
g = torch.Generator().manual_seed(0)
bind = {{}}
for b in prog.buffers:
    if b.kind in (BufferKind.IO_INPUT, BufferKind.WEIGHT, BufferKind.CONST, BufferKind.KV_CACHE):
        dt = b.dtype.torch
        if dt.is_floating_point:
            bind[b.source] = torch.randn(b.shape, generator=g).to(dt)
        else:
            bind[b.source] = torch.zeros(b.shape, dtype=dt)
for b, t in zip(prog.outputs, ReferenceVM(prog).run(bind)):
    print(prog.buffers[b].name, tuple(t.shape), t.flatten()[:8])
'''


def _unique_dir(root: Path, name: str) -> Path:
    d = root / name
    i = 1
    while d.exists():
        d = root / f"{name}_{i}"
        i += 1
    return d


def dump_stages(low, root: Path | None = None, which: str = "", debug: int = 0) -> None:
    """Write low's stages to a new folder under root (if given); print the stages named in
    `which` ("all" or "<pass>[,<pass>]", or every stage at debug >= 3) to stderr."""
    if root is None and not which and debug < 3:
        return
    stages = low.stages
    if root is not None:
        d = _unique_dir(root, low.graph.name)
        d.mkdir(parents=True)
        files = [name if "." in name else f"{i:02d}_{name}.txt" for i, name in enumerate(stages)]
        for f, text in zip(files, stages.values()):      # kernel.cu keeps its name
            (d / f).write_text(text + "\n")
        if "cubin" in stages and low.cuda_build().compiled is not None:   # the binary stage
            (d / "kernel.cubin").write_bytes(low.cuda_build().compiled.cubin)
        final = files[len(low.programs)]                 # the program after the last pass
        (d / "repro.py").write_text(_REPRO.format(final=final))
        print(f"[amk] dumped {len(stages)} stages of {low.graph.name} to {d}", file=sys.stderr)
    wanted = set(which.split(",")) if which else set()
    for i, (name, text) in enumerate(stages.items()):
        backend_stage = i > len(low.programs)             # printed from debug level 4 on
        if debug >= 3 + backend_stage or "all" in wanted or name in wanted:
            print(f"// ----- {low.graph.name}: after {name} -----\n{text}", file=sys.stderr)
