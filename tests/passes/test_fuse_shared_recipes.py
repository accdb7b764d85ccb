"""fuse shares equal FUSED recipes between tasks (a decoder's layers repeat) without merging
recipes whose params print differently."""
import amk
from amk.models.presets import TINY_LLAMA, random_model
from amk.passes.fuse import _Step, to_task
from amk.passes.options import PassOptions
from amk.program.ir import InstructionKind as K, Task


def test_a_decoders_layers_share_their_recipes():
    m = random_model(TINY_LLAMA)
    prog = amk.jit(m.fn, donate=("kv",), options=PassOptions.for_backend("cuda")).lower(
        *m.example_args()).program
    fused = [t for t in prog.tasks if t.op is K.FUSED]
    recipes = {id(t.params["recipe"]) for t in fused}
    assert fused and len(recipes) < len(fused)
    assert len(recipes) == len({repr(t.params["recipe"]) for t in fused})


def _fused(params, recipes, memo):
    like = Task(0, K.ADD, (1, 2), (3,), {}, (), 0)
    steps = [_Step(K.ADD, (("b", 1), ("b", 2)), ("b", 3), params)]
    return to_task(steps, like, "t", recipes, memo).params["recipe"]


def test_recipes_are_shared_only_when_their_params_print_alike():
    recipes, memo = {}, {}
    a = _fused({"n_off": 0, "N_tile": 4}, recipes, memo)
    assert _fused({"n_off": 0, "N_tile": 4}, recipes, memo) is a
    assert _fused({"N_tile": 4, "n_off": 0}, recipes, memo) is not a     # another order
    assert _fused({"n_off": 0.0, "N_tile": 4}, recipes, memo) is not a   # 0.0 == 0
    assert _fused({"n_off": False, "N_tile": 4}, recipes, memo) is not a
