"""FUSED recipes (amk/program/recipe.py): the dict form parses into the typed form and back, the
one validator names the step, and no text form prints an op as a number."""
import json
import re

import pytest

from amk.errors import ValidationError
from amk.program.ir import DType, InstructionKind as K, Task
from amk.program.recipe import (INPUT, OUTPUT, SCRATCH, Operand, Recipe, RecipeError, Step,
                                parse_recipe, recipe_errors, recipe_of)
from amk.program.text import parse_program, program_from_json, program_to_json, program_to_text

from test_validate import fused

# today's dict form, as cached programs and hand-written tests hold it (ops as numbers)
LEGACY = {"steps": [
    {"op": 5, "args": [{"in": 0}, {"in": 1}], "out": 0, "params": {"n_off": 0, "N_tile": 4},
     "out_shape": [1, 8], "out_dtype": "float32"},
    {"op": 12, "args": [{"s": 0}, {"in": 2}], "out": -1, "params": {}},
    {"op": 1, "args": [{"s": 0}], "out": {"o": 1}},
]}
TYPED = Recipe((
    Step(K.GEMV_TILE, (Operand(INPUT, 0), Operand(INPUT, 1)), Operand(SCRATCH, 0),
         {"n_off": 0, "N_tile": 4}, (1, 8), DType.F32),
    Step(K.ADD, (Operand(SCRATCH, 0), Operand(INPUT, 2)), Operand(OUTPUT, 0), {}),
    Step(K.COPY, (Operand(SCRATCH, 0),), Operand(OUTPUT, 1), {}),
))


def test_the_dict_form_parses_into_the_typed_form_and_back():
    assert parse_recipe(LEGACY) == TYPED
    assert parse_recipe(TYPED) is TYPED
    d = TYPED.to_dict()
    assert [s["op"] for s in d["steps"]] == ["GEMV_TILE", "ADD", "COPY"]
    assert d["steps"][0]["out_dtype"] == "f32" and d["steps"][1]["out"] == "final"
    assert parse_recipe(d) == TYPED
    assert parse_recipe(json.loads(json.dumps(d))) == TYPED       # through JSON
    assert TYPED.root_op() is K.ADD


def test_the_text_form_names_ops_and_operands():
    assert str(TYPED.steps[0]) == "s0:f32[1,8] = GEMV_TILE(in0, in1) n_off=0 N_tile=4"
    assert str(TYPED.steps[2]) == "out1 = COPY(s0)"


def test_one_dtype_table_reads_old_and_new_names():
    for old, new in (("bfloat16", "bf16"), ("float16", "f16"), ("int32", "i32"), ("uint8", "u8")):
        a = {"steps": [{"op": "COPY", "args": [{"in": 0}], "out": 0, "out_dtype": old},
                       {"op": "COPY", "args": [{"s": 0}], "out": "final"}]}
        b = {"steps": [{**a["steps"][0], "out_dtype": new}, a["steps"][1]]}
        assert parse_recipe(a) == parse_recipe(b)
    assert any("i4" in e and "allowlist" in e for e in recipe_errors(
        {"steps": [{"op": "COPY", "args": [{"in": 0}], "out": "final", "out_dtype": "i4"}]}, 1))


def test_a_malformed_recipe_names_the_task_and_the_step():
    bad = {"steps": [{"op": "RMSNORM", "args": [{"in": 0}], "out": 0},
                     {"op": "GEMV_TILE", "args": [{"s": 0}, {"in": 7}], "out": "final"}]}
    t = Task(4, K.FUSED, (0, 1), (2,), {"recipe": bad}, (), 0, "wq+rmsnorm[0/2]")
    with pytest.raises(RecipeError, match=r"task t4 \(wq\+rmsnorm\[0/2\]\).*\n.*step 1 "
                                          r"\(GEMV_TILE\): input index 7 out of range") as e:
        recipe_of(t)
    assert isinstance(e.value, ValidationError)


def test_every_error_is_listed_even_when_a_step_does_not_parse():
    errs = recipe_errors({"steps": [{"op": "ADD", "args": [{"in": 9}, {"s": 4}], "out": "x"},
                                    {"op": 99, "args": [{"in": 0}], "out": 0}]}, 1, 1)
    assert len(errs) == 5, errs     # bad out, unknown op, input 9, scratch 4, no output written
    assert errs[0].startswith("step 0 (ADD): out must be") and "step 1: unknown op 99" in errs[1]


def test_program_text_and_json_print_recipe_ops_by_name_and_read_them_back():
    prog = fused().build()
    text = program_to_text(prog)
    assert '"op": "GEMV_TILE"' in text and not re.search(r'"op": \d', text)
    assert parse_program(text) == prog
    js = json.dumps(program_to_json(prog))
    assert '"op": "ADD"' in js and not re.search(r'"op": \d', js)
    back = program_from_json(js)
    assert back == prog and isinstance(back.tasks[0].params["recipe"], Recipe)


def test_a_program_text_with_a_malformed_recipe_is_a_parse_error_naming_the_line():
    text = program_to_text(fused().build()).replace('"op": "ADD"', '"op": "NOPE"', 1)
    with pytest.raises(ValueError, match=r"line \d+: malformed FUSED recipe:\n  step 1: unknown op"):
        parse_program(text)
