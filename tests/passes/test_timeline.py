"""The estimated timeline: valid Chrome-trace events, properly nested, loops included."""

from __future__ import annotations

import json

import optax

import xla_strategies as xs
from tests import helpers
from xla_strategies.demo import models
from xla_strategies.passes.timeline import chrome_trace


def assert_properly_nested(trace: dict) -> None:
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events and all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
    assert all(e["dur"] >= 0 for e in events)
    for tid in {e["tid"] for e in events}:
        spans = sorted((e["ts"], -e["dur"]) for e in events if e["tid"] == tid)
        stack: list[float] = []
        for start, negative in spans:
            end = start - negative
            while stack and stack[-1] <= start + 1e-9:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-9, (tid, start, end, stack[-1])
            stack.append(end)


def test_transformer_timeline_nests_loop_bodies_inside_loops():
    strategy = xs.TPUStrategy("v5e-8", emulate=True)
    graphdef, params, cfg = helpers.transformer(layers=3)
    tx = optax.adamw(1e-3)
    batch = next(iter(strategy.experimental_distribute_dataset(helpers.lm_batches(1, cfg))))
    step = strategy.compile(models.lm_train_step(graphdef, tx))
    graph = step.graph(params, tx.init(params), batch, after="decompose-all-reduces")
    trace = json.loads(json.dumps(chrome_trace(graph, strategy.topology)))  # JSON-clean
    assert_properly_nested(trace)
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert "jax.scan x3" in names
    collective = next(e for e in trace["traceEvents"] if e.get("tid") == 2 and e["ph"] == "X")
    assert collective["dur"] > 0 and collective["args"]["bytes"] > 0
