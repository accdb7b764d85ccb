"""The rank simulator (amk/backends/reference/ranks.py): n rank programs with cross-rank
all-reduces run together on one device; a rank that never arrives is an error, not a hang."""
import pytest
import torch

import amk
from amk import ops
from amk.backends import make_executable
from amk.backends.reference.ranks import run_ranks
from amk.errors import BackendUnavailable, DeadlockError, TraceError, ValidationError
from amk.ops import RankGroup
from amk.program.collectives import collective_tasks
from amk.program.ir import InstructionKind as K


def rank_fn(group, n_reduce=1, argmax=False):
    def f(x):
        y = x
        for _ in range(n_reduce):
            y = ops.allreduce(ops.mul(y, 2.0), group)
        return ops.argmax(y, group) if argmax else y
    return amk.jit(f, backend="reference")


def run(xs, fns, order="program", seed=0):
    exes, binds = zip(*(f.executable(x) for f, x in zip(fns, xs)))
    return run_ranks(list(exes), list(binds), order, seed), list(exes)


@pytest.mark.parametrize("order", ["program", "random"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sum_allreduce_gives_every_rank_the_sum(world, order):
    xs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    fns = [rank_fn(RankGroup(r, world), n_reduce=2) for r in range(world)]
    outs, _ = run(xs, fns, order)
    once = sum(2 * x for x in xs)
    want = world * 2 * once          # the second all-reduce sums world copies of 2 * once
    for (y,) in outs:
        torch.testing.assert_close(y, want)
    assert all(torch.equal(outs[0][0], o[0]) for o in outs)     # the same bits on every rank


@pytest.mark.parametrize("world", [2, 4])
def test_maxloc_is_the_global_argmax_with_the_lowest_index_on_ties(world):
    g = torch.Generator().manual_seed(world)
    full = torch.randint(0, 3, (5, 4 * world), generator=g).float()   # many ties, across ranks too
    full[0] = 1.0                                                     # a row of all ties
    full[1, 4 * world - 1] = float("nan")                             # NaN counts as the max
    xs = list(full.chunk(world, dim=1))
    fns = [rank_fn(RankGroup(r, world), n_reduce=0, argmax=True) for r in range(world)]
    outs, _ = run([x.contiguous() for x in xs], fns)
    want = torch.argmax(full, dim=-1).to(torch.int32)
    for (ids,) in outs:
        assert torch.equal(ids, want)
    assert int(want[0]) == 0 and int(want[1]) == 4 * world - 1


def test_a_rank_that_never_arrives_is_a_deadlock_error_and_the_vms_stay_usable():
    xs = [torch.ones(1, 8), torch.ones(1, 8)]
    fns = [rank_fn(RankGroup(0, 2), n_reduce=2), rank_fn(RankGroup(1, 2), n_reduce=1)]
    with pytest.raises(DeadlockError) as e:
        run(xs, fns)
    msg = str(e.value)
    assert "ranks [0] wait in collective #1" in msg
    assert "rank 1 finished its program: it has 1 collectives" in msg
    # counters were put back: the rank-0 VM still pairs with a matching rank 1
    fixed = [fns[0], rank_fn(RankGroup(1, 2), n_reduce=2)]
    outs, _ = run(xs, fixed)
    torch.testing.assert_close(outs[0][0], torch.full((1, 8), 16.0))


def test_steps_repeat_with_monotonic_counters():
    fns = [rank_fn(RankGroup(r, 2)) for r in range(2)]
    for step in range(3):
        xs = [torch.full((1, 4), float(step + r)) for r in range(2)]
        outs, exes = run(xs, fns, order="random", seed=step)
        torch.testing.assert_close(outs[1][0], torch.full((1, 4), 2.0 * (2 * step + 1)))
    assert [vm.epoch for vm in exes] == [3, 3]


def test_programs_that_do_not_form_one_group_are_refused():
    xs = [torch.ones(1, 8), torch.ones(1, 8)]
    with pytest.raises(ValidationError, match="is rank 0 of 2, but it runs as rank 1 of 2"):
        run(xs, [rank_fn(RankGroup(0, 2)), rank_fn(RankGroup(0, 2))])
    with pytest.raises(ValidationError, match=r"collective #0: rank 1's task .* \[1, 4\]"):
        run([torch.ones(1, 8), torch.ones(1, 4)], [rank_fn(RankGroup(r, 2)) for r in range(2)])


def test_one_vm_alone_refuses_a_rank_of_a_larger_world():
    f = rank_fn(RankGroup(0, 2))
    with pytest.raises(ValidationError, match="needs its peers' parts.*run_ranks"):
        f(torch.ones(1, 8))


def test_a_world_of_one_runs_on_the_plain_vm():
    x = torch.randn(3, 10)
    torch.testing.assert_close(rank_fn(RankGroup(0, 1))(x), 2 * x)
    ids = rank_fn(RankGroup(0, 1), n_reduce=0, argmax=True)(x)
    assert torch.equal(ids, torch.argmax(x, -1).to(torch.int32))


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backends_refuse_rank_programs(backend):
    prog = rank_fn(RankGroup(0, 2)).lower(torch.ones(1, 8)).program
    assert len(collective_tasks(prog)) == 1
    with pytest.raises(BackendUnavailable, match="cross-rank all-reduce .*rank 0 of 2"):
        make_executable(prog, backend, torch.device("cpu"))


def test_op_errors():
    def one_tensor_no_group(x):
        return ops.allreduce(x)

    def bad_group(x):
        return ops.allreduce(x, (0, 2))

    with pytest.raises(TraceError, match="one tensor needs group=amk.ops.RankGroup"):
        amk.jit(one_tensor_no_group).lower(torch.ones(1, 4))
    with pytest.raises(TraceError, match="'group' must be an amk.ops.RankGroup"):
        amk.jit(bad_group).lower(torch.ones(1, 4))
    with pytest.raises(TraceError, match="0 <= rank < world"):
        RankGroup(2, 2)


def test_validate_refuses_a_collective_inside_a_fused_recipe():
    from amk.program.recipe import INPUT, OUTPUT, Operand, Recipe, Step
    prog = rank_fn(RankGroup(0, 2)).lower(torch.ones(1, 8)).program
    t = collective_tasks(prog)[0]
    step = Step(t.op, (Operand(INPUT, 0),), Operand(OUTPUT, 0), dict(t.params))
    fused = t.with_(op=K.FUSED, params={"recipe": Recipe((step,))})
    bad = prog.with_(tasks=tuple(fused if u.id == t.id else u for u in prog.tasks))
    result = amk.validate(bad)
    assert not result.ok and "cannot be a recipe step" in result.report()
