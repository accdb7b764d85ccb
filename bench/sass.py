"""The machine code of a preset's decode step, read on any machine (no GPU): the step lowered for
the cuda backend (meta weights; quantized ones on the CPU, over --layers layers), NVRTC's cubin
for sm_90a, disassembled by cuobjdump (`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`,
the test extra has them). Writes kernel.cu, kernel.cubin, kernel.sass and ptxas.log into --out;
prints a table and writes it as JSON (--out/sass.json):

- the cubin's md5 (a change that must not change the machine code keeps it) and its size;
- ptxas's spills, per function;
- counts of the opcodes that say where the data comes from: LDG (global), LDS (shared), LD
  (generic: shared memory reached through a pointer the compiler lost track of, NOTES v47's
  ring), PRMT (a quantized weight each), HMMA, FFMA;
- in blocks of 32 PRMT or more (the quantized GEMV loops): instructions a weight;
- chains of global loads, each issued only after the one before it returned (a register it
  needs, its address or, predicated, its old value, comes from that load): combine_direct's
  16 m loads were one (NOTES v47).
- the loops that touch local memory (LDL / STL), each with its HMMA count and whether it is
  innermost: a spill in a GEMV's k-block loop costs every k-block, one in its sweep loop once a
  sweep (NOTES v53).
- each device function's bytes of code (the ELF symbols; the kernel entry's own code is the
  scheduler): a layer runs ~100-120 KB of them one after another, where the SM's instruction
  cache keeps ~32-64 KB at full speed and ~128 KB at half (bench/icache_probe.py, NOTES v58).

    python bench/sass.py --model llama-3.2-1b --out /tmp/s_1b
    python bench/sass.py --model llama-3.2-1b --quant int4 --out /tmp/s_i4
    python bench/sass.py --model llama-3.2-1b --batch 16 --out /tmp/s_b16
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))   # amk without PYTHONPATH
from gpu_tool import parser  # noqa: E402

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_REG = re.compile(r"\bR(\d+)(\.64)?\b")
_BLOCK_END = ("BRA", "EXIT", "RET", "CALL", "JMP")


@dataclass(frozen=True)
class Instr:
    addr: int
    pred: str            # "" or e.g. "@P0"
    op: str              # opcode with its modifiers, e.g. LDG.E.128
    args: str            # operands as printed

    def dst(self) -> set[int]:
        """Registers the instruction writes (its first operand, for the usual ALU and load forms)."""
        first = self.args.split(",", 1)[0]
        return _regs(first) if not self.op.startswith(("ST", "RED", "BAR", "BRA", "LDGSTS")) else set()

    def src(self) -> set[int]:
        parts = self.args.split(",", 1)
        reads = _regs(parts[1]) if len(parts) > 1 else set()
        if self.op.startswith(("ST", "RED")):
            reads |= _regs(parts[0])
        if self.pred:                        # a predicated write keeps the old value: a read
            reads |= self.dst()
        return reads


def _regs(text: str) -> set[int]:
    out = set()
    for m in _REG.finditer(text):
        r = int(m.group(1))
        out |= {r, r + 1} if m.group(2) else {r}
    return out


def parse(sass: str) -> list[Instr]:
    """cuobjdump -sass text -> instructions in address order (every function together)."""
    out = []
    for line in sass.splitlines():
        m = _LINE.search(line)
        if m:
            out.append(Instr(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return out


def is_global_load(i: Instr) -> bool:
    """LDG (global) or LD (generic, may be global); not LDGSTS (cp.async) or LDGDEPBAR."""
    return i.op.split(".")[0] in ("LDG", "LD")


def opcode_counts(instrs: list[Instr]) -> dict[str, int]:
    """Instructions of each kind by the opcode's first part (LDG is not LDGSTS, LDS not LDSM)."""
    out = dict.fromkeys(("LDG", "LDS", "LD", "PRMT", "HMMA", "FFMA"), 0)
    for i in instrs:
        head = i.op.split(".")[0]
        if head in out:
            out[head] += 1
    return out


def permute_blocks(instrs: list[Instr], min_prmt: int = 32) -> list[float]:
    """Instructions a weight in each straight-line block (between branches) with >= min_prmt PRMT."""
    out, block = [], []
    for i in instrs:
        block.append(i)
        if i.op.startswith(_BLOCK_END):
            n = sum(1 for x in block if x.op == "PRMT")
            if n >= min_prmt:
                out.append(round(len(block) / n, 2))
            block = []
    return out


def load_chains(instrs: list[Instr], min_len: int = 4) -> list[tuple[int, int]]:
    """(address of the first load, length) of each chain of >= min_len global loads in which
    every load needs a register derived from the one before it. Straight-line code only: the
    taint is dropped at every branch."""
    taint: dict[int, int] = {}        # register -> index of the load its value came from
    depth: dict[int, int] = {}        # load index -> its chain's length so far
    first: dict[int, int] = {}        # load index -> its chain's first load's address
    for k, i in enumerate(instrs):
        if i.op.startswith(_BLOCK_END):
            taint.clear()
            continue
        feeds = {taint[r] for r in i.src() if r in taint}
        if is_global_load(i):
            before = max(feeds, key=lambda f: depth[f], default=None)
            depth[k] = 1 if before is None else depth[before] + 1
            first[k] = i.addr if before is None else first[before]
            for r in i.dst():
                taint[r] = k
        else:
            src = max(feeds, key=lambda f: depth[f], default=None)
            for r in i.dst():
                if src is None:
                    taint.pop(r, None)
                else:
                    taint[r] = src
    ends: dict[int, int] = {}
    for k, n in depth.items():
        if n >= min_len:
            ends[first[k]] = max(ends.get(first[k], 0), n)
    return sorted(ends.items())


def loops(instrs: list[Instr]) -> list[dict]:
    """Every loop (a branch back to an address before it; not the branch to itself that pads a
    function after its EXIT): its span, its instructions, its HMMA and its local-memory accesses
    (LDL / STL: ptxas's spills), and whether no other loop lies inside it. A spill once a sweep
    is not one once a k-block: NOTES v53."""
    spans = []
    for i in instrs:
        m = re.match(r"0x([0-9a-f]+)", i.args)
        if i.op.startswith("BRA") and m and int(m.group(1), 16) < i.addr:
            spans.append((int(m.group(1), 16), i.addr))
    out = []
    for lo, hi in sorted(set(spans)):
        body = [i for i in instrs if lo <= i.addr <= hi]
        heads = [i.op.split(".")[0] for i in body]
        inner = not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans)
        out.append({"start": lo, "end": hi, "instructions": len(body), "hmma": heads.count("HMMA"),
                    "local": heads.count("LDL") + heads.count("STL"), "innermost": inner})
    return out


def spills(log: str) -> dict[str, str]:
    """{function (mangled, as ptxas names it): its spill line}, for the functions that spill."""
    out, fn = {}, "?"
    for ln in log.splitlines():
        m = re.search(r"Function properties for (\S+)", ln)
        if m:
            fn = m.group(1)
        elif "spill" in ln and "0 bytes spill stores, 0 bytes spill loads" not in ln:
            out[fn] = re.sub(r"^ptxas\s+\.\s+", "", ln.strip())
    return out


def cuobjdump() -> str:
    """The cuobjdump binary, with nvdisasm beside it or on PATH (it calls nvdisasm)."""
    found = shutil.which("cuobjdump")
    if not found:
        try:
            import nvidia
            roots = list(nvidia.__path__)
        except ImportError:
            roots = []
        hits = [p for r in roots for p in glob.glob(os.path.join(r, "*", "bin", "cuobjdump"))]
        found = hits[0] if hits else None
    if not found:
        raise SystemExit("bench/sass.py needs cuobjdump and nvdisasm: "
                         "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    return found


def disassemble(cubin: Path, what: str = "-sass") -> str:
    """cuobjdump's text of the cubin: its SASS (-sass) or its ELF sections (-elf)."""
    tool = cuobjdump()
    env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run([tool, what, str(cubin)], capture_output=True, text=True, env=env)
    if r.returncode != 0 or ("Function" if what == "-sass" else ".symtab") not in r.stdout:
        raise SystemExit(f"cuobjdump failed on {cubin}: {(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout


def function_bytes(elf: str) -> dict[str, int]:
    """`cuobjdump -elf` text -> {device function: bytes of code}, largest first: the local FUNC
    symbols by identifier (a mangled name's template arguments and parameters cut; instantiations
    of one template told apart by a count, #2 ...), the entry's own code = its size less theirs."""
    rows = re.findall(r"^\s*\S+\s+\S+\s+(0x[0-9a-f]+)\s+FUNC\s+(\w+)\s+\w+\s+\S+\s+\S+\s+(\S+)\s*$",
                      elf, re.M)
    out, entry = {}, None
    for size, bind, name in rows:
        if bind == "GLOBAL":
            entry = (name, int(size, 16))
            continue
        base = name.split("$")[-1]
        m = re.match(r"_Z(\d+)", base)            # the mangled name: _Z<length><identifier>...
        short = base[m.end():m.end() + int(m.group(1))] if m else base
        key, k = short, 1
        while key in out:
            k += 1
            key = f"{short} #{k}"
        out[key] = int(size, 16)
    if entry:
        out[f"{entry[0]} (scheduler)"] = entry[1] - sum(out.values())
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def compile_step(cfg, quant: str | None, batch: int):
    """(kernel.cu, CompileResult) of a DecoderConfig's decode step for sm_90a: meta weights, or
    quantized ones on the CPU (quant: a Model.quantize format). shape_scan.py uses it too."""
    from amk.backends.cuda.codegen import render
    from amk.backends.cuda.compile import compile_source
    from amk.models.presets import random_model
    m = random_model(cfg, device="cpu" if quant else "meta")
    if quant:
        m.quantize(quant)
    low = m.lower(backend="cuda", batch=batch)
    src = render(low.program, low.cuda_options)
    return src, compile_source(src, "sm_90a", use_cache=False, cuda_options=low.cuda_options)


def build(model: str, quant: str | None, batch: int, max_seq: int, layers: int | None):
    """(kernel.cu, CompileResult) of the preset's step for sm_90a."""
    from amk.models.presets import PRESETS
    if model not in PRESETS:
        raise SystemExit(f"bench/sass.py: unknown preset {model!r}; choose one of {sorted(PRESETS)}")
    cfg = replace(PRESETS[model], max_seq=max_seq)
    if layers is not None:
        cfg = replace(cfg, n_layers=layers)
    return compile_step(cfg, quant, batch)


def report(sass: str, log: str, cubin: bytes) -> dict:
    instrs = parse(sass)
    return {"md5": hashlib.md5(cubin).hexdigest(), "cubin_bytes": len(cubin), "instructions": len(instrs),
            "spills": spills(log), "opcodes": opcode_counts(instrs),
            "permute_blocks": permute_blocks(instrs), "load_chains": load_chains(instrs),
            "loops_with_local_memory": [lp for lp in loops(instrs) if lp["local"]]}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default="llama-3.2-1b", help="a preset (amk.models.presets)")
    ap.add_argument("--quant", default=None, help="int8 | int4 | fp8 (Model.quantize)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-seq", type=int, default=8192, help="KV cache rows")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers to build (default: the preset's; 2 with --quant, which quantizes on the CPU)")
    ap.add_argument("--out", required=True, help="folder for kernel.cu, kernel.cubin, kernel.sass, ptxas.log, sass.json")
    a = ap.parse_args(argv)
    if a.batch < 1 or a.max_seq < 1:
        ap.error("--batch and --max-seq must be positive")
    layers = a.layers if a.layers is not None else (2 if a.quant else None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    src, res = build(a.model, a.quant, a.batch, a.max_seq, layers)
    (out / "kernel.cu").write_text(src)
    (out / "kernel.cubin").write_bytes(res.cubin)
    (out / "ptxas.log").write_text(res.log)
    sass = disassemble(out / "kernel.cubin")
    (out / "kernel.sass").write_text(sass)
    rep = {"model": a.model, "quant": a.quant or "bf16", "batch": a.batch, "max_seq": a.max_seq,
           "layers": layers, **report(sass, res.log, res.cubin),
           "function_bytes": function_bytes(disassemble(out / "kernel.cubin", "-elf"))}
    (out / "sass.json").write_text(json.dumps(rep, indent=1))
    ops = rep["opcodes"]
    print(f"{a.model} {rep['quant']} batch {a.batch} max_seq {a.max_seq}: cubin {rep['md5']} "
          f"({rep['cubin_bytes']} B), {rep['instructions']} instructions")
    print("| " + " | ".join(ops) + " |\n|" + "---|" * len(ops) + "\n| " + " | ".join(str(v) for v in ops.values()) + " |")
    print("spills: " + ("; ".join(f"{fn}: {line}" for fn, line in rep["spills"].items()) or "none"))
    print("permute blocks (instructions a weight): " + (" ".join(map(str, rep["permute_blocks"])) or "none"))
    print("global-load chains (address: length): "
          + (" ".join(f"{addr:#x}: {n}" for addr, n in rep["load_chains"]) or "none"))
    print("loops with local memory (span: instructions, HMMA, LDL+STL, innermost): "
          + (" ".join(f"{lp['start']:#x}-{lp['end']:#x}: {lp['instructions']}, {lp['hmma']}, {lp['local']}"
                      f"{', innermost' if lp['innermost'] else ''};" for lp in rep["loops_with_local_memory"]) or "none"))
    print("code bytes by device function: "
          + ", ".join(f"{fn} {n}" for fn, n in rep["function_bytes"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
