"""Fold Nsight Compute's per-instruction table of the megakernel into time per device function.

Inputs (see bench/profile/ncu_step.py): the SASS source page as CSV (`ncu -i R --page source --csv
--print-source sass`), the cubin built with AMK_LINEINFO=1 (its line table maps each SASS
offset to a line of the kernel source; nvdisasm reads it) and that kernel source (the
functions are found by their definitions). Prints, per device function (the innermost one
an instruction's line belongs to): warp-stall samples, their top stall reasons, instructions
executed; then the hottest source lines, and every local-memory (spill) instruction executed.

    python bench/profile/ncu_summary.py sass.csv kernel.cubin kernel.cu [--nvdisasm PATH] [--top 40]
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import shutil
import subprocess
import sys

_FUNC = re.compile(r"^(?:template\s*<[^>]*>\s*)?(?:extern \"C\" )?(?:__device__|__global__)[^;{]*?"
                   r"\b(\w+)\s*\(")
_LINE = re.compile(r'//## File "[^"]*", line (\d+)')
_OFF = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def functions_by_line(src: str) -> list[str]:
    """For each 1-based source line, the name of the function whose body holds it ('' outside)."""
    names = [""]
    current, depth, pending = "", 0, ""
    for line in src.splitlines():
        head = re.sub(r"__launch_bounds__\([^)]*\)", "", line.strip())   # not the function's name
        m = _FUNC.match(head) if depth == 0 else None
        if m:
            pending = m.group(1)
        if depth == 0 and pending and "{" in line:
            current, pending = pending, ""
        names.append(current)
        depth += line.count("{") - line.count("}")
        if depth <= 0:
            depth, current = 0, ("" if "}" in line else current)
    return names


def line_of_offsets(disasm: str) -> dict[int, tuple[int, str]]:
    """SASS offset -> (innermost source line, instruction text) from `nvdisasm -c -gi`."""
    out, line = {}, 0
    for row in disasm.splitlines():
        m = _LINE.search(row)
        if m:
            line = int(m.group(1))      # the first File line of a block is the innermost
            continue
        m = _OFF.search(row)
        if m:
            out[int(m.group(1), 16)] = (line, m.group(2))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass_csv")
    ap.add_argument("cubin")
    ap.add_argument("source")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    disasm = subprocess.run([a.nvdisasm, "-c", "-gi", a.cubin], capture_output=True, text=True,
                            check=True).stdout
    where = line_of_offsets(disasm)
    fn_of = functions_by_line(open(a.source).read())
    src_lines = open(a.source).read().splitlines()
    rows = list(csv.reader(open(a.sass_csv)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = rows[head]
    col = {c: i for i, c in enumerate(cols)}
    stall_cols = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    body = [r for r in rows[head + 1:] if r and r[0].startswith("0x")]
    base = int(body[0][0], 16)
    num = lambda r, c: float(r[col[c]].replace(",", "") or 0)  # noqa: E731
    per_fn = collections.defaultdict(lambda: collections.Counter())
    per_line = collections.Counter()
    spills = []
    total = 0.0
    for r in body:
        off = int(r[0], 16) - base
        line, text = where.get(off, (0, r[1].strip()))
        fn = fn_of[line] if 0 < line < len(fn_of) else "?"
        s = num(r, "Warp Stall Sampling (All Samples)")
        total += s
        d = per_fn[fn]
        d["samples"] += s
        d["executed"] += num(r, "Instructions Executed")
        for c in stall_cols:
            d[c] += num(r, c)
        per_line[line] += s
        if re.match(r"(@!?P\d\s+)?(LDL|STL)", text) and num(r, "Instructions Executed"):
            spills.append((num(r, "Instructions Executed"), s, fn, line, text))
    print(f"{len(body)} instructions, {total:.0f} warp-stall samples")
    print(f"{'function':>34} {'samples':>9} {'%':>6} {'executed':>12}  top stalls (% of the function)")
    for fn, d in sorted(per_fn.items(), key=lambda kv: -kv[1]["samples"]):
        if d["samples"] < total * 0.002:
            continue
        top = sorted(((d[c], c[6:]) for c in stall_cols), reverse=True)[:4]
        tops = ", ".join(f"{n} {v / d['samples'] * 100:.0f}" for v, n in top if v)
        print(f"{fn or '(top level)':>34} {d['samples']:>9.0f} {d['samples'] / total * 100:>6.1f} "
              f"{d['executed']:>12.0f}  {tops}")
    print(f"\nhottest {a.top} source lines (samples, %, function: text)")
    for line, s in per_line.most_common(a.top):
        text = src_lines[line - 1].strip()[:90] if 0 < line <= len(src_lines) else "?"
        print(f"{line:>6} {s:>8.0f} {s / total * 100:>5.1f}  {fn_of[line] if line < len(fn_of) else '?'}: {text}")
    if spills:
        print(f"\nlocal-memory instructions executed ({len(spills)}; executed, samples, function, line, SASS)")
        for e, s, fn, line, text in sorted(spills, reverse=True)[:a.top]:
            print(f"{e:>10.0f} {s:>7.0f}  {fn}:{line}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
