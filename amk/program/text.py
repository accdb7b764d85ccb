"""A Program as readable text (one line per buffer, counter and task) and as a JSON dict.

    program chain outputs=(b3)
    buffers:
      b0 x io_input f32[1,8] source="token"
    counters:
      c0 init=0
    tasks:
      t12 GEMV_TILE in=(b3,b7) out=(b9) waits=(c4>=2) -> c9 {"n_off": 0, "N_tile": 256} # wq[0/2]
    queues:
      q0 (t0,t1,t12)

Both forms round-trip exactly: `parse_program(program_to_text(p)) == p`. Params are a JSON
object (inf/-inf, bools); tuples are kept as {"__tuple__": [...]}; a FUSED recipe is its dict
form with op names (amk/program/recipe.py) and is read back into a Recipe. Names that are not
one plain word are JSON-quoted.
"""
from __future__ import annotations

import enum
import json
import re
from typing import Any, Mapping

from amk.errors import AmkError
from amk.program.ir import (Buffer, BufferKind, Counter, DType, InstructionKind, Program, Task,
                            Wait)
from amk.program.recipe import Recipe, RecipeError, parse_recipe

FORMAT = "amk.program/1"


class ProgramParseError(AmkError, ValueError):
    """Program text or JSON that does not parse; says which line and what was expected."""


# ---------------------------------------------------------------------------------------------
# params <-> JSON
# ---------------------------------------------------------------------------------------------
_TUPLE = "__tuple__"


def _encode(v: Any, where: str) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, Recipe):
        return _encode(v.to_dict(), where)      # op names, not numbers
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, tuple):
        return {_TUPLE: [_encode(x, where) for x in v]}
    if isinstance(v, list):
        return [_encode(x, where) for x in v]
    if isinstance(v, Mapping):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise ProgramParseError(f"{where}: param key {k!r} is not a string; "
                                        "params must be JSON-like (str keys)")
            out[k] = _encode(x, where)
        return out
    raise ProgramParseError(f"{where}: param value {v!r} ({type(v).__name__}) has no text "
                            "form; use ints, floats, strings, bools, lists, tuples or dicts")


def _decode_hook(d: dict) -> Any:
    if len(d) == 1 and _TUPLE in d:
        return tuple(d[_TUPLE])
    return d


def _task_params(op: InstructionKind, params: dict, where: str) -> dict:
    """Decoded params, with a FUSED task's recipe read back into a Recipe."""
    if op is InstructionKind.FUSED and "recipe" in params:
        try:
            params["recipe"] = parse_recipe(params["recipe"])
        except RecipeError as e:
            raise ProgramParseError(f"{where}: malformed FUSED recipe:\n  "
                                    + str(e).replace("\n", "\n  ")) from None
    return params


def params_to_json(params: Mapping[str, Any], where: str = "params") -> str:
    return json.dumps(_encode(params, where), separators=(", ", ": "))


def _params_from(obj: Any) -> dict:
    # Re-run the hook through a dumps/loads cycle so a plain-JSON dict decodes tuples too.
    return json.loads(json.dumps(obj), object_hook=_decode_hook)


# ---------------------------------------------------------------------------------------------
# one line per thing
# ---------------------------------------------------------------------------------------------
_PLAIN = re.compile(r'[^\s"]+')


def _word(s: str) -> str:
    """s as one token: bare if it is a plain word, else JSON-quoted."""
    return s if s and _PLAIN.fullmatch(s) else json.dumps(s)


def _ids(prefix: str, xs) -> str:
    return "(" + ",".join(f"{prefix}{x}" for x in xs) + ")"


def buffer_to_text(b: Buffer) -> str:
    shape = ",".join(str(s) for s in b.shape)
    src = f" source={json.dumps(b.source)}" if b.source else ""
    return f"b{b.id} {_word(b.name)} {b.kind.name.lower()} {b.dtype.short}[{shape}]{src}"


def counter_to_text(c: Counter) -> str:
    return f"c{c.id} init={c.init}"


def task_to_text(t: Task) -> str:
    waits = ",".join(f"c{w.counter}>={w.threshold}" for w in t.waits)
    name = ""
    if t.name:
        plain = t.name == t.name.strip() and t.name.isprintable() and not t.name.startswith('"')
        name = " # " + (t.name if plain else json.dumps(t.name))
    return (f"t{t.id} {t.op.name} in={_ids('b', t.inputs)} out={_ids('b', t.outputs)} "
            f"waits=({waits}) -> c{t.out_counter} {params_to_json(t.params, f't{t.id}')}{name}")


def program_to_text(p: Program) -> str:
    lines = [f"program {_word(p.name)} outputs={_ids('b', p.outputs)}", "buffers:"]
    lines += ["  " + buffer_to_text(b) for b in p.buffers]
    lines.append("counters:")
    lines += ["  " + counter_to_text(c) for c in p.counters]
    lines.append("tasks:")
    lines += ["  " + task_to_text(t) for t in p.tasks]
    if p.queues:
        lines.append("queues:")
        lines += [f"  q{i} {_ids('t', q)}" for i, q in enumerate(p.queues)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------
_TOKEN = re.compile(r'(?:[^\s"]|"(?:[^"\\]|\\.)*")+')   # words; quoted strings may hold spaces
_BUFFER = re.compile(r'b(\d+) (\S+) ([a-z_]+) ([a-z0-9]+)\[([\d,]*)\]')
_TASK = re.compile(r't(\d+) (\w+) in=\(([^)]*)\) out=\(([^)]*)\) waits=\(([^)]*)\) -> c(-?\d+) ')
_WAIT = re.compile(r'c(-?\d+)>=(-?\d+)')
_decoder = json.JSONDecoder(object_hook=_decode_hook)


def _unword(tok: str) -> str:
    return json.loads(tok) if tok.startswith('"') else tok


def _id_list(s: str, prefix: str, where: str) -> tuple[int, ...]:
    if not s.strip():
        return ()
    out = []
    for part in s.split(","):
        part = part.strip()
        if not part.startswith(prefix):
            raise ProgramParseError(f"{where}: expected {prefix}<id>, got {part!r}")
        out.append(int(part[len(prefix):]))
    return tuple(out)


def _parse_buffer(line: str, where: str) -> Buffer:
    toks = _TOKEN.findall(line)
    # re-join the name token, then match the fixed part
    if len(toks) < 4:
        raise ProgramParseError(f"{where}: expected 'b<id> <name> <kind> <dtype>[shape]', got {line!r}")
    m = _BUFFER.fullmatch(" ".join(["X" if i == 1 else t for i, t in enumerate(toks[:4])]))
    if not m:
        raise ProgramParseError(f"{where}: expected 'b<id> <name> <kind> <dtype>[shape]', got {line!r}")
    source = ""
    for extra in toks[4:]:
        if not extra.startswith("source="):
            raise ProgramParseError(f"{where}: unexpected {extra!r} after the buffer's shape")
        source = json.loads(extra[len("source="):])
    shape = tuple(int(s) for s in m.group(5).split(",")) if m.group(5) else ()
    return Buffer(int(m.group(1)), _unword(toks[1]), BufferKind[m.group(3).upper()],
                  DType.parse(m.group(4)), shape, source)


def _parse_task(line: str, where: str) -> Task:
    m = _TASK.match(line)
    if not m:
        raise ProgramParseError(f"{where}: expected 't<id> OP in=(..) out=(..) waits=(..) -> c<id> "
                                f"{{params}} [# name]', got {line!r}")
    try:
        params, end = _decoder.raw_decode(line, m.end())
    except json.JSONDecodeError as e:
        raise ProgramParseError(f"{where}: params are not a JSON object: {e}") from None
    rest = line[end:]
    name = ""
    if rest.startswith(" # "):
        name = rest[3:]
        if name.startswith('"'):
            name = json.loads(name)
    elif rest.strip():
        raise ProgramParseError(f"{where}: unexpected {rest!r} after the params")
    waits = []
    for w in filter(None, (x.strip() for x in m.group(5).split(","))):
        wm = _WAIT.fullmatch(w)
        if not wm:
            raise ProgramParseError(f"{where}: a wait is c<id>>=<threshold>, got {w!r}")
        waits.append(Wait(int(wm.group(1)), int(wm.group(2))))
    try:
        op = InstructionKind[m.group(2)]
    except KeyError:
        raise ProgramParseError(f"{where}: unknown opcode {m.group(2)!r}") from None
    return Task(int(m.group(1)), op, _id_list(m.group(3), "b", where),
                _id_list(m.group(4), "b", where), _task_params(op, params, where), tuple(waits),
                int(m.group(6)), name)


def parse_program(text: str) -> Program:
    """The Program that `program_to_text` printed."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("program "):
        raise ProgramParseError("line 1: expected 'program <name> outputs=(..)'")
    head = _TOKEN.findall(lines[0])
    if len(head) != 3 or not head[2].startswith("outputs=("):
        raise ProgramParseError(f"line 1: expected 'program <name> outputs=(..)', got {lines[0]!r}")
    name = _unword(head[1])
    outputs = _id_list(head[2][len("outputs=("):-1], "b", "line 1")
    buffers, counters, tasks, queues = [], [], [], []
    section = None
    for n, raw in enumerate(lines[1:], 2):
        where = f"line {n}"
        if not raw.strip():
            continue
        if not raw.startswith("  "):
            section = raw.strip().rstrip(":")
            if section not in ("buffers", "counters", "tasks", "queues"):
                raise ProgramParseError(f"{where}: unknown section {raw!r}")
            continue
        line = raw[2:]
        try:
            if section == "buffers":
                buffers.append(_parse_buffer(line, where))
            elif section == "counters":
                cm = re.fullmatch(r"c(\d+) init=(-?\d+)", line)
                if not cm:
                    raise ProgramParseError(f"{where}: expected 'c<id> init=<n>', got {line!r}")
                counters.append(Counter(int(cm.group(1)), int(cm.group(2))))
            elif section == "tasks":
                tasks.append(_parse_task(line, where))
            elif section == "queues":
                qm = re.fullmatch(r"q\d+ \(([^)]*)\)", line)
                if not qm:
                    raise ProgramParseError(f"{where}: expected 'q<i> (t<id>,..)', got {line!r}")
                queues.append(_id_list(qm.group(1), "t", where))
            else:
                raise ProgramParseError(f"{where}: an indented line before any section")
        except (KeyError, ValueError) as e:
            if isinstance(e, ProgramParseError):
                raise
            raise ProgramParseError(f"{where}: {e} in {line!r}") from None
    return Program(tuple(buffers), tuple(counters), tuple(tasks), tuple(queues), name, outputs)


# ---------------------------------------------------------------------------------------------
# JSON dict form
# ---------------------------------------------------------------------------------------------
def program_to_json(p: Program) -> dict:
    """A plain JSON-serialisable dict (json.dumps works on it)."""
    return {
        "format": FORMAT, "name": p.name, "outputs": list(p.outputs),
        "buffers": [{"id": b.id, "name": b.name, "kind": b.kind.name, "dtype": b.dtype.name,
                     "shape": list(b.shape), "source": b.source} for b in p.buffers],
        "counters": [{"id": c.id, "init": c.init} for c in p.counters],
        "tasks": [{"id": t.id, "op": t.op.name, "inputs": list(t.inputs),
                   "outputs": list(t.outputs), "params": _encode(t.params, f"t{t.id}"),
                   "waits": [[w.counter, w.threshold] for w in t.waits],
                   "out_counter": t.out_counter, "name": t.name} for t in p.tasks],
        "queues": [list(q) for q in p.queues],
    }


def program_from_json(d: Mapping[str, Any] | str) -> Program:
    """Inverse of program_to_json; also takes the JSON text."""
    if isinstance(d, str):
        d = json.loads(d)
    if d.get("format", FORMAT) != FORMAT:
        raise ProgramParseError(f"unknown program format {d.get('format')!r}; expected {FORMAT}")
    try:
        buffers = tuple(Buffer(b["id"], b["name"], BufferKind[b["kind"]], DType[b["dtype"]],
                               tuple(b["shape"]), b.get("source", "")) for b in d["buffers"])
        counters = tuple(Counter(c["id"], c.get("init", 0)) for c in d["counters"])
        tasks = tuple(Task(t["id"], InstructionKind[t["op"]], tuple(t["inputs"]),
                           tuple(t["outputs"]),
                           _task_params(InstructionKind[t["op"]], _params_from(t.get("params", {})),
                                        f"task t{t['id']}"),
                           tuple(Wait(c, th) for c, th in t.get("waits", [])),
                           t["out_counter"], t.get("name", "")) for t in d["tasks"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProgramParseError(f"program JSON is missing or has a bad field: {e!r}") from None
    return Program(buffers, counters, tasks, tuple(tuple(q) for q in d.get("queues", [])),
                   d.get("name", "program"), tuple(d.get("outputs", [])))
