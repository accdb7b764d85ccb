"""FUSED recipes: the steps one FUSED task runs over private scratch (docs/PROGRAM.md, FUSED).

A FUSED task's ``params["recipe"]`` is a `Recipe`: a tuple of `Step`s, each one primitive op
(any InstructionKind but FUSED) reading `Operand`s (the task's inputs, or scratch written by an
earlier step) and writing one (a task output or a scratch slot). Scratch carries the shape and
dtype of the unfused intermediate buffer, so the fused task is bit-identical to the unfused ops.

The dict form is what programs serialised before this module hold (and what hand-written test
programs use); `parse_recipe` reads it, `Recipe.to_dict` writes it (with op names)::

    {"steps": [{"op": "RMSNORM" | 3,                      # a name or an opcode number
                "args": [{"in": k} | {"s": j}, ...],      # inputs[k] or scratch j
                "out": j | "final" | -1 | {"o": k},       # scratch j, outputs[0], outputs[k]
                "params": {...},                          # the primitive op's params
                "out_shape": [...], "out_dtype": "bf16"}]}   # a scratch's shape and dtype

`recipe_errors` is the one validator (every backend and `amk.validate` use it, through
`checked_recipe` / `recipe_of`, which raise a RecipeError naming the task and every bad step).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, NamedTuple

from amk.errors import ValidationError
from amk.program.ir import DType, InstructionKind, Task

INPUT, OUTPUT, SCRATCH = "in", "out", "s"

# The one table of scratch dtype names: AMK's short names, plus the torch names older programs
# wrote. I4 is a quantization code, never a tensor's dtype.
RECIPE_DTYPES: dict[str, DType] = {
    "float32": DType.F32, "float16": DType.F16, "bfloat16": DType.BF16, "int32": DType.I32,
    "int8": DType.I8, "uint8": DType.U8, "int64": DType.I64,
    **{d.short: d for d in DType if d is not DType.I4},
}


class RecipeError(ValidationError):
    """A FUSED recipe that does not parse or check; the message lists every problem."""


@dataclass(frozen=True)
class Operand:
    """One of the task's inputs (in), outputs (out), or the recipe's scratch slots (s)."""
    kind: str
    index: int

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


@lru_cache(maxsize=None)
def operand(kind: str, index: int) -> Operand:
    """The one shared Operand of (kind, index): a pickled program then holds each once, not
    ~10^5 copies (unpickling the 1B program's recipes: 2.2 -> 1.0 s)."""
    return Operand(kind, index)


@dataclass(frozen=True)
class Step:
    op: InstructionKind
    args: tuple[Operand, ...]
    out: Operand
    params: Mapping[str, Any]
    out_shape: tuple[int, ...] | None = None    # scratch only; None: like args[0]
    out_dtype: DType | None = None              # scratch only; None: like args[0]

    def to_dict(self) -> dict:
        out: Any = self.out.index
        if self.out.kind == OUTPUT:
            out = "final" if self.out.index == 0 else {"o": self.out.index}
        d = {"op": self.op.name, "args": [{a.kind: a.index} for a in self.args], "out": out,
             "params": dict(self.params)}
        if self.out_shape is not None:
            d["out_shape"] = list(self.out_shape)
        if self.out_dtype is not None:
            d["out_dtype"] = self.out_dtype.short
        return d

    def __str__(self) -> str:
        out = str(self.out)
        if self.out_shape is not None or self.out_dtype is not None:
            dt = self.out_dtype.short if self.out_dtype is not None else "?"
            shape = ",".join(map(str, self.out_shape)) if self.out_shape is not None else "?"
            out += f":{dt}[{shape}]"
        ps = " ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{out} = {self.op.name}({', '.join(map(str, self.args))})" + (f" {ps}" if ps else "")


@dataclass(frozen=True)
class Recipe:
    steps: tuple[Step, ...]

    def to_dict(self) -> dict:
        return {"steps": [s.to_dict() for s in self.steps]}

    def root_op(self) -> InstructionKind:
        """The op of the step writing the task's first output (FUSED if none does)."""
        first = operand(OUTPUT, 0)          # usually the very object (a quick `is`)
        for s in self.steps:
            if s.out is first or s.out == first:
                return s.op
        return InstructionKind.FUSED

    def __str__(self) -> str:
        return "; ".join(map(str, self.steps))

    def __repr__(self) -> str:
        # every field is in the short form: a canonical repr (the cuda lowered cache keys on
        # repr(program)) at a third of the generic dataclass repr's cost on a 1B program
        return f"Recipe<{self}>"


# ---------------------------------------------------------------------------------------------
# the dict form -> Recipe, and the one validator
# ---------------------------------------------------------------------------------------------
class _Partial(NamedTuple):
    """What parsed of one step of the dict form (None where a field did not), so that a bad
    recipe's every error is found in one go."""
    op: InstructionKind | None
    args: tuple[Operand, ...]
    out: Operand | None
    out_shape: tuple[int, ...] | None


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _op(v: Any) -> InstructionKind:
    if isinstance(v, str):
        return InstructionKind[v]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(v)
    return InstructionKind(v)


def _arg(a: Any) -> Operand | None:
    if isinstance(a, Mapping) and len(a) == 1:
        (kind, index), = a.items()
        if kind in (INPUT, SCRATCH) and _is_index(index):
            return operand(kind, index)
    return None


def _out(o: Any) -> Operand | None:
    if o == "final" or (isinstance(o, int) and not isinstance(o, bool) and o == -1):
        return operand(OUTPUT, 0)
    if isinstance(o, Mapping) and set(o) == {"o"} and _is_index(o["o"]):
        return operand(OUTPUT, o["o"])
    if _is_index(o):
        return operand(SCRATCH, o)
    return None


def _step(i: int, st: Any, errs: list[str]) -> tuple[Step | None, _Partial | None]:
    """(the Step, or None when malformed; what parsed of it) of step i of the dict form."""
    if not isinstance(st, Mapping):
        errs.append(f"step {i}: must be a dict, got {type(st).__name__}")
        return None, None
    n = len(errs)
    try:
        op = _op(st.get("op"))
        where = f"step {i} ({op.name})"
    except (KeyError, ValueError):
        errs.append(f"step {i}: unknown op {st.get('op')!r}")
        op, where = None, f"step {i}"
    raw_args = st.get("args", [])
    if not isinstance(raw_args, (list, tuple)):
        errs.append(f"{where}: args must be a list, got {raw_args!r}")
        raw_args = []
    args = []
    for a in raw_args:
        arg = _arg(a)
        if arg is None:
            errs.append(f"{where}: arg must be {{'in': k}} or {{'s': j}} with k, j >= 0, got {a!r}")
        else:
            args.append(arg)
    out = _out(st.get("out"))
    if out is None:
        errs.append(f"{where}: out must be a scratch index j >= 0, 'final' or {{'o': k}}, "
                    f"got {st.get('out')!r}")
    shape = st.get("out_shape")
    if shape is not None and not (isinstance(shape, (list, tuple)) and all(map(_is_index, shape))):
        errs.append(f"{where}: out_shape must be a list of non-negative ints, got {shape!r}")
        shape = None
    od = st.get("out_dtype")
    if od is not None and od not in RECIPE_DTYPES:
        errs.append(f"{where}: out_dtype {od!r} is not in the allowlist {sorted(RECIPE_DTYPES)}")
    params = st.get("params", {})
    if not isinstance(params, Mapping):
        errs.append(f"{where}: params must be a dict, got {type(params).__name__}")
    shape = tuple(shape) if shape is not None else None
    partial = _Partial(op, tuple(args), out, shape)
    if len(errs) > n:
        return None, partial
    return Step(op, tuple(args), out, dict(params), shape,
                RECIPE_DTYPES[od] if od is not None else None), partial


def _parse(obj: Any) -> tuple[Recipe | None, list[_Partial | Step], list[str]]:
    if isinstance(obj, Recipe):
        return obj, list(obj.steps), []
    if not isinstance(obj, Mapping):
        return None, [], [f"recipe must be a dict with a 'steps' list, got {type(obj).__name__}"]
    raw = obj.get("steps")
    if not isinstance(raw, (list, tuple)) or not raw:
        return None, [], ["recipe.steps must be a non-empty list"]
    errs: list[str] = []
    parsed = [_step(i, st, errs) for i, st in enumerate(raw)]
    steps = [p for _, p in parsed if p is not None]
    if errs:
        return None, steps, errs
    return Recipe(tuple(s for s, _ in parsed)), steps, []


def parse_recipe(obj: Any) -> Recipe:
    """A Recipe from its dict form (a Recipe is returned as it is); RecipeError lists every
    malformed step."""
    recipe, _, errs = _parse(obj)
    if errs:
        raise RecipeError("\n".join(errs))
    return recipe


def _fit_errors(steps, n_inputs: int, n_outputs: int) -> list[str]:
    """Every way steps (Steps, or what parsed of them) do not fit a task with these many inputs
    and outputs: operands in range, scratch written before read, every output written."""
    errs: list[str] = []
    scratch: set[int] = set()
    written: set[int] = set()
    for i, st in enumerate(steps):
        where = f"step {i} ({st.op.name})" if st.op is not None else f"step {i}"
        if st.op is InstructionKind.FUSED:
            errs.append(f"{where}: nested FUSED is not allowed")
        for a in st.args:
            if a.kind == INPUT and a.index >= n_inputs:
                errs.append(f"{where}: input index {a.index} out of range [0, {n_inputs})")
            elif a.kind == SCRATCH and a.index not in scratch:
                errs.append(f"{where}: reads scratch {a.index} not written by an earlier step")
        if st.out is None:
            continue
        if st.out.kind == OUTPUT:
            if st.out.index >= n_outputs:
                errs.append(f"{where}: output index {st.out.index} out of range "
                            f"[0, {n_outputs})")
            written.add(st.out.index)
        else:
            if st.out_shape is None and not st.args:
                errs.append(f"{where}: scratch {st.out.index} needs out_shape (the step has "
                            f"no args)")
            scratch.add(st.out.index)
    missing = sorted(set(range(n_outputs)) - written)
    if missing and steps:
        errs.append(f"recipe never writes output(s) {missing} (a step needs out 'final' or "
                    f"{{'o': k}})")
    return errs


# A Recipe is immutable, so its verdict for given operand counts never changes; the passes and
# backends check each recipe many times (fuse, cost, validate, the cuda lowering: ~1 s a 1B
# compile). Memoised by object (held, so its id cannot be reused meanwhile).
_VERDICTS: dict[tuple[int, int, int], tuple[Recipe, list[str]]] = {}
_VERDICTS_MAX = 200_000


def recipe_errors(obj: Any, n_inputs: int, n_outputs: int = 1) -> list[str]:
    """The one recipe validator: every error of a recipe (either form) for a task with these
    many inputs and outputs ([] when well formed)."""
    if isinstance(obj, Recipe):
        key = (id(obj), n_inputs, n_outputs)
        hit = _VERDICTS.get(key)
        if hit is None or hit[0] is not obj:
            if len(_VERDICTS) > _VERDICTS_MAX:
                _VERDICTS.clear()
            hit = _VERDICTS[key] = (obj, _fit_errors(obj.steps, n_inputs, n_outputs))
        return list(hit[1])
    _, steps, errs = _parse(obj)
    return errs + _fit_errors(steps, n_inputs, n_outputs)


def checked_recipe(obj: Any, n_inputs: int, n_outputs: int, where: str = "") -> Recipe:
    """The recipe (either form) parsed and checked; a RecipeError (a ValidationError) names
    `where` (the task, when the caller knows it) and every bad step."""
    errs = recipe_errors(obj, n_inputs, n_outputs)
    if errs:
        raise RecipeError(f"{where + ': ' if where else ''}malformed FUSED recipe:\n  "
                          + "\n  ".join(errs)
                          + "\nfix the fusion pass (or program) that built it")
    return parse_recipe(obj)


def recipe_of(task: Task) -> Recipe:
    """A FUSED task's recipe, checked against its inputs and outputs."""
    return checked_recipe(task.params.get("recipe"), len(task.inputs), len(task.outputs),
                          f"task t{task.id} ({task.name or 'FUSED'})")
