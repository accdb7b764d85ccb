"""The graph-looped generate's chunk order (amk/models/device_loop.chunk_order), on the CPU:
every chunk is enqueued once and taken once, in order, never before it is enqueued, with at
most `depth` further chunks in flight while one is read, and the last chunk taken too (the
first H200 run lost the final chunk's tokens: 42 of 45, 18 of 20)."""
import pytest

from amk.models.device_loop import chunk_order


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("depth", [0, 1])
def test_every_chunk_is_taken_in_order_after_its_enqueue(n, depth):
    order = chunk_order(n, depth)
    assert [j for kind, j in order if kind == "enqueue"] == list(range(n))
    assert [j for kind, j in order if kind == "take"] == list(range(n))
    in_flight = 0
    for kind, j in order:
        if kind == "enqueue":
            in_flight += 1
            assert in_flight <= depth + 1           # two host buffers suffice for depth 1
        else:
            assert ("enqueue", j) in order[:order.index((kind, j))]
            in_flight -= 1
    assert in_flight == 0


def test_depth_one_overlaps_the_next_replay_with_the_read():
    assert chunk_order(3, 1) == [("enqueue", 0), ("enqueue", 1), ("take", 0), ("enqueue", 2),
                                 ("take", 1), ("take", 2)]
    assert chunk_order(2, 0) == [("enqueue", 0), ("take", 0), ("enqueue", 1), ("take", 1)]
