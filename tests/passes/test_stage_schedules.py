"""Pipeline schedules as data: each runs every microbatch through every stage in an order
its dependencies allow, with the bubble its theory gives and the memory it promises."""

import pytest

from xla_strategies.passes.stages.schedules import SCHEDULES, schedule

CASES = [(s, m) for s in (2, 4) for m in (4, 8)]


INTERLEAVED = ("interleaved-1f1b", "interleaved-1f1b-paired", "looped-bfs")


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "1f1b-paired", *INTERLEAVED])
@pytest.mark.parametrize("stages, microbatches", CASES)
def test_the_bubble_is_the_schedules_theory(name, stages, microbatches):
    virtual = 2 if name in INTERLEAVED else 1
    table = schedule(name, stages, microbatches, virtual)
    assert table.bubble == pytest.approx(table.theoretical_bubble, rel=0.05)
    # (S-1)/(M+S-1), divided by about V for the interleaved schedule
    plain = (stages - 1) / (microbatches + stages - 1)
    assert table.theoretical_bubble == pytest.approx(
        plain if virtual == 1 else (stages - 1) / (virtual * microbatches + stages - 1)
    )


@pytest.mark.parametrize("stages, microbatches", CASES)
def test_one_f_one_b_keeps_at_most_s_microbatches_alive_where_gpipe_keeps_m(stages, microbatches):
    assert schedule("gpipe", stages, microbatches).kept_alive() == microbatches
    assert schedule("1f1b", stages, microbatches).kept_alive() == min(stages, microbatches)
    paired = schedule("1f1b-paired", stages, microbatches)
    assert paired.kept_alive() == min(2 * stages - 1, microbatches)
    assert paired.ticks == microbatches + 2 * stages - 2  # GPipe's: 2 (M+S-1)
    # interleaved, paired in the memory it keeps unpaired
    interleaved = schedule("interleaved-1f1b", stages, microbatches, 2)
    assert schedule("interleaved-1f1b-paired", stages, microbatches, 2).kept_alive() == (
        interleaved.kept_alive()
    )


def test_zero_bubble_fills_part_of_one_f_one_b_bubble_in_its_memory():
    zb = schedule("zero-bubble-h1", 4, 8)
    one_f_one_b = schedule("1f1b", 4, 8)
    # in ticks of one F, B or W: 1F1B's backward is two of them
    one_f_one_b_bubble = 2 * 3 / (3 * 8 + 2 * 3)
    assert zb.theoretical_bubble < zb.bubble < one_f_one_b_bubble
    assert zb.kept_alive() == one_f_one_b.kept_alive()


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_action_runs_once_after_what_it_needs(name):
    virtual = 2 if name in INTERLEAVED else 1
    table = schedule(name, 4, 8, virtual)
    when = {}
    for device, steps in enumerate(table.steps):
        ticks = [s.tick for s in steps]
        assert ticks == sorted(ticks)  # in list order
        for tick in set(ticks):  # one action a tick; paired, a forward and a backward
            kinds = sorted(s.action.kind for s in steps if s.tick == tick)
            assert len(kinds) == 1 or (table.paired and kinds == ["B", "F"]), kinds
        for s in steps:
            when[(s.action.kind, s.action.microbatch, s.action.chunk * 4 + device)] = s.tick
    last = virtual * 4 - 1
    for (kind, m, g), tick in when.items():
        if kind == "F" and g > 0:
            assert when[("F", m, g - 1)] < tick
        if kind == "B":  # paired: the forward first in the same tick
            assert when[("F", m, g)] < tick or (table.paired and when[("F", m, g)] == tick)
            if g < last:
                assert when[("B", m, g + 1)] < tick


@pytest.mark.parametrize(
    "args, message",
    [
        (("1f1b", 4, 8, 2), "virtual_stages=2 is for schedule='interleaved-1f1b'"),
        (("interleaved-1f1b", 4, 6, 2), "microbatches=6 is not a multiple of pipeline_stages=4"),
        (("interleaved-1f1b", 4, 8, 1), "needs virtual_stages >= 2"),
        (("looped-bfs", 2, 3, 2), "schedule=.looped-bfs. runs microbatches in groups"),
        (("pipedream", 4, 8, 1), "schedule='pipedream' is not one of"),
        (("gpipe", 0, 8, 1), "pipeline_stages must be a positive int"),
        (("gpipe", 2, 0, 1), "microbatches must be a positive int"),
    ],
)
def test_what_does_not_fit_is_named(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        schedule(*args)
