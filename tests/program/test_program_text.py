"""Program text and JSON forms round-trip exactly; the text is the documented one-line-per-task."""
import json
import math

import pytest

from amk.program.ir import BufferKind, DType, InstructionKind as K, Wait
from amk.program.text import (ProgramParseError, parse_program, program_from_json,
                              program_to_json, program_to_text, task_to_text)

from test_validate import Builder, VALID, attention, big_program, fused, tiled

ALL = {**VALID, "fused": fused, "big": lambda: big_program(layers=20)}


def odd_program():
    """Names with spaces, quotes and '#', awkward params, queues and program outputs."""
    p = Builder('odd "name" # 1')
    x = p.buf("x with space", (1, 4), BufferKind.IO_INPUT)
    y = p.buf('y"q', (4,), BufferKind.IO_OUTPUT, DType.BF16)
    s = p.buf("scalar", (), BufferKind.CONST)
    p.buffers[s] = p.buffers[s].__class__(s, "scalar", BufferKind.CONST, DType.F32, (), "consts['a b']")
    params = {"scale": 0.1, "neg": -math.inf, "pos": math.inf, "flag": True, "none": None,
              "s": "text # with } brace", "tup": (1, (2, 3)), "lst": [1.5, [2, {"k": (4,)}]],
              "big": 2 ** 62, "tiny": 5e-324, "qdtype": DType.I4}
    t0 = p.task(K.MUL, [x], [y], params, name="  leading space")
    p.task(K.NOP, [], [], waits=[(t0, 1)], name='"quoted" name\nnewline')
    p.task(K.NOP, [], [], waits=[(t0, 1), (1, 1)], counter=1, name="plain # hash")
    prog = p.build(queues=[(0, 2), (1,)])
    return prog.with_(outputs=(y,))


def _programs():
    return [(name, make().build()) for name, make in ALL.items()] + [("odd", odd_program())]


@pytest.mark.parametrize("name,prog", _programs(), ids=[n for n, _ in _programs()])
def test_text_round_trip(name, prog):
    text = program_to_text(prog)
    back = parse_program(text)
    assert back == prog
    assert program_to_text(back) == text


@pytest.mark.parametrize("name,prog", _programs(), ids=[n for n, _ in _programs()])
def test_json_round_trip(name, prog):
    d = program_to_json(prog)
    assert program_from_json(d) == prog
    assert program_from_json(json.loads(json.dumps(d))) == prog
    assert program_from_json(json.dumps(d)) == prog


def test_params_keep_their_types():
    back = parse_program(program_to_text(odd_program())).tasks[0].params
    assert back["tup"] == (1, (2, 3)) and isinstance(back["tup"], tuple)
    assert isinstance(back["lst"], list) and back["lst"][1][1]["k"] == (4,)
    assert back["neg"] == -math.inf and back["pos"] == math.inf
    assert back["flag"] is True and back["none"] is None and back["tiny"] == 5e-324
    assert back["qdtype"] == 7


def test_task_line_format():
    t = tiled().build().tasks[2]
    assert task_to_text(t) == ('t2 ADD in=(b2,b3) out=(b4) waits=(c0>=2) -> c1 '
                               '{"n_off": 0, "N_tile": 16} # add[0/2]')
    t = t.with_(waits=(Wait(0, 2), Wait(3, 1)), name="")
    assert task_to_text(t).endswith("waits=(c0>=2,c3>=1) -> c1 {\"n_off\": 0, \"N_tile\": 16}")


def test_text_is_readable():
    text = program_to_text(attention().build())
    lines = text.splitlines()
    assert lines[0] == "program attention outputs=()"
    assert "  b4 k_cache kv_cache f32[16,2,4]" in lines
    assert "  c0 init=0" in lines
    assert any(line.startswith("  t2 ATTENTION_TILE in=(b1,b4,b5,b0) out=(b6) waits=(c0>=1,c1>=1)")
               and line.endswith("# attn[g0 s0]") for line in lines)


def test_recipe_round_trips():
    prog = fused().build()
    back = parse_program(program_to_text(prog))
    assert back.tasks[1].params["recipe"] == prog.tasks[1].params["recipe"]


@pytest.mark.parametrize("text,needle", [
    ("nope\n", "line 1"),
    ("program p outputs=()\ntasks:\n  t0 BOGUS in=() out=() waits=() -> c0 {}\n", "unknown opcode"),
    ("program p outputs=()\ntasks:\n  t0 NOP in=() out=() waits=(x) -> c0 {}\n", "wait"),
    ("program p outputs=()\ntasks:\n  t0 NOP in=() out=() waits=() -> c0 {oops}\n", "JSON"),
    ("program p outputs=()\nbuffers:\n  b0 x nokind f32[1]\n", "line 3"),
])
def test_parse_errors_say_where(text, needle):
    with pytest.raises(ProgramParseError, match=needle):
        parse_program(text)


def test_unencodable_param_is_a_clear_error():
    p = tiled()
    p.tasks[0] = p.tasks[0].with_(params={"fn": object()})
    with pytest.raises(ProgramParseError, match="t0"):
        program_to_text(p.build())
