"""Each fold of folds.FOLDS on its own, on the hand-built FUSED programs of
amk/testing/cuda_examples.py: the steps the folds before it left, what it merges, and that it
leaves steps it does not apply to alone. (The whole chain on a 1B layer: test_cuda_folds.py.)"""
import pytest

from amk.program.ir import InstructionKind as K
from amk.backends.cuda.folds import FOLDS, fold_steps
from amk.backends.cuda.fused import lower_fused
from amk.backends.cuda.lower import _view
from amk.backends.cuda.steps import REF_SCRATCH, Fused
from amk.testing import cuda_examples as examples

FOLD = dict(FOLDS)


def _lowered(case) -> Fused:
    p = case.program
    (t,) = [t for t in p.tasks if t.op is K.FUSED]
    return lower_fused(t, [_view(p.buffers[b]) for b in t.inputs],
                       [_view(p.buffers[b]) for b in t.outputs], 0)[0]


def _before(case, name: str) -> Fused:
    """The case's FUSED task as the folds before `name` leave it."""
    f = _lowered(case)
    for n, fold in FOLDS:
        if n == name:
            return f
        f = fold(f)
    raise KeyError(name)


def _ops(f: Fused) -> list[str]:
    return [K(e.op).name for e, _, _ in f.steps]


def test_folds_are_one_named_ordered_list_and_fold_steps_runs_them_all():
    names = [n for n, _ in FOLDS]
    assert len(set(names)) == len(names) and names[0] == "norm_into_smem"
    assert all(fold.__doc__ for _, fold in FOLDS)
    f = _lowered(examples.gate_up_case())
    assert _ops(fold_steps(f)) == ["GEMV_TILE"]


@pytest.mark.parametrize("name", [n for n, _ in FOLDS])
def test_a_fold_leaves_a_lone_elementwise_step_alone(name):
    case = next(c for c in examples.cases() if c.name == "add_bcast_tile")
    p = case.program
    t = p.tasks[0]
    from amk.backends.cuda.encoders import encode_op
    ins, outs = [_view(p.buffers[b]) for b in t.inputs], [_view(p.buffers[b]) for b in t.outputs]
    f = Fused([(encode_op(t, t.op, ins, outs, t.params), ins, outs)], [(0, 64)])
    g = FOLD[name](f)
    assert g.steps == f.steps and g.zero == f.zero


def test_norm_into_smem_hands_the_combines_x_to_the_gemv_in_shared_memory():
    f = _before(examples.combine_o_add_case(), "norm_into_smem")
    (c, _, co), (g, ga, _), _ = f.steps
    assert co[0].ref[0] == REF_SCRATCH and ga[0].ref == co[0].ref
    assert (REF_SCRATCH, co[0].ref[1]) in [(REF_SCRATCH, o) for o, _ in f.zero]
    out = FOLD["norm_into_smem"](f)
    (c2, _, _), (g2, _, _), _ = out.steps
    assert (c2.ip["TO_SMEM"], g2.ip["XS_READY"]) == (1, 1) and "TO_SMEM" not in c.ip
    assert not out.zero                                  # never in global memory: never zeroed


def test_k_rope_into_attention_rotates_the_new_k_row_in_the_attention():
    f = _before(examples.rope_new_kv_attention_case(), "k_rope_into_attention")
    assert _ops(f) == ["ROPE", "ROPE", "ATTENTION_TILE"]
    _, att_args, _ = f.steps[2]
    (_, kra, _), = [s for s in f.steps[:2] if s[2][0].ref == att_args[4].ref]   # k_new's rope
    out = FOLD["k_rope_into_attention"](f)
    assert _ops(out) == ["ROPE", "ATTENTION_TILE"]
    a, aa, _ = out.steps[-1]
    assert a.ip["K_ROPE"] == 1 and not a.ip.get("Q_ROPE") and aa[4].ref == kra[0].ref


def test_rope_into_attention_rotates_q_while_it_is_staged():
    f = _before(examples.rope_new_kv_attention_case(), "rope_into_attention")
    (r, ra, _), _ = f.steps
    out = FOLD["rope_into_attention"](f)
    ((a, aa, _),) = out.steps
    assert a.is_fn("op_attention_smem") and (a.ip["Q_ROPE"], a.ip["K_ROPE"]) == (1, 1)
    assert aa[0].ref == ra[0].ref and a.fp["THETA"] == r.fp["THETA"]


def test_rope_into_append_rotates_the_rows_as_it_appends_them():
    f = _before(examples.fused_case(), "rope_into_append")
    assert _ops(f)[-2:] == ["ROPE", "KV_APPEND"]
    r, ra, _ = f.steps[-2]
    out = FOLD["rope_into_append"](f)
    assert _ops(out) == _ops(f)[:-2] + ["KV_APPEND"]
    a, aa, _ = out.steps[-1]
    assert a.ip["ROPE_HD"] == r.ip["HD"] and aa[0].ref == ra[0].ref


def test_pair_gemvs_makes_gate_up_and_silu_one_gemv_of_two_matrices():
    f = _before(examples.gate_up_case(), "pair_gemvs")
    assert _ops(f) == ["RMSNORM", "GEMV_TILE", "GEMV_TILE", "SILU_MUL"]
    (_, ga, _), (_, ua, _), (_, _, so) = f.steps[1:]
    out = FOLD["pair_gemvs"](f)
    assert _ops(out) == ["RMSNORM", "GEMV_TILE"]
    g, args, outs = out.steps[1]
    assert (g.variant.arg("nmat"), g.variant.arg("epi")) == (2, 2)
    assert [a.ref for a in args] == [ga[0].ref, ga[1].ref, ua[1].ref] and outs == so


def test_fold_add_adds_the_residual_in_the_gemvs_epilogue():
    f = _before(examples.combine_o_add_case(), "fold_add")
    (_, _, go), (_, aa, ao) = f.steps[1:]
    out = FOLD["fold_add"](f)
    assert _ops(out) == ["ATTENTION_COMBINE", "GEMV_TILE"]
    g, args, outs = out.steps[1]
    res = aa[1] if aa[0].ref == go[0].ref else aa[0]
    assert g.variant.arg("epi") == 1 and args[-1] == res and outs == ao


def test_norm_into_gemv_normalises_x_in_the_gemv():
    f = _before(examples.gate_up_case(), "norm_into_gemv")
    (n, na, _), (g, ga, go) = f.steps
    out = FOLD["norm_into_gemv"](f)
    ((e, args, outs),) = out.steps
    assert e.variant.arg("norm") and e.variant.arg("rn") == -(-n.ip["H"] // 512)
    assert e.ip["XS_READY"] == 0 and e.fp["EPS"] == n.fp["EPS"]
    assert args == [na[0]] + ga[1:] + [na[1]] and outs == go
