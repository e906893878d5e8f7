"""IR text round trip, parse errors with positions, and verifier rejections."""

from __future__ import annotations

import pytest

from xla_strategies.passes import IRParseError, VerificationError, parse, print_graph, verify
from xla_strategies.passes.ir.graph import Graph, Node, OutputAttrs, Split, Value

MESH = {"replica": 8}

LOOP = """\
func @step(%0: f32[4,3] loc("args[0]['w']"), %1: f32[2,4]{replica} loc("args[1]")) {
  %2: f32[4,3]{replica} = pvary(%0) {"axes": ["replica"]}
  %3: f32[4,3] = all_reduce(%2) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}  // by insert-reductions
  %4: f32[], %5: f32[3,2]{replica} = jax.scan(%3, %1) {"length": 3, "num_carry": 0, "num_consts": 2, "reverse": false, "unroll": 1}
    region (%6: f32[4,3], %7: f32[2,4]{replica}) {
      %8: f32[] = constant() {"value": 1.5}
      %9: f32[2]{replica} = jax.reduce_sum(%7) {"axes": [1]}
      return %8, %9
    }
  %10: bf16[8]{replica} = jax.iota() {"dimension": 0}
  return %3 mirrored loc("output[0]"), %5 loc("output[1]"), %10
}
"""


def test_round_trip_is_exact():
    graph = parse(LOOP)
    assert print_graph(graph) == LOOP
    assert [a.mirrored for a in graph.io.outputs] == [True, False, False]
    assert [a.name for a in graph.io.outputs] == ["output[0]", "output[1]", None]
    assert graph.inputs[0].name == "args[0]['w']"
    assert graph.nodes[1].created_by == "insert-reductions"
    verify(graph, MESH)


def test_state_and_sharded_layouts_round_trip():
    text = """\
func @step(%0: f32[16,4] loc("w"), %1: f32[2,4]{x,y} sharded=0{y,x} donated loc("m")) {
  %2: f32[2,4]{x,y} = jax.mul(%1, %1)
  return %0 state=%0, %2 state=%1 sharded=0{y,x} loc("out")
}
"""
    graph = parse(text)
    assert print_graph(graph) == text
    assert graph.io.state_pairs() == {0: 0, 1: 1}
    assert [a.donated for a in graph.io.inputs] == [False, True]
    split = Split(0, ("y", "x"))
    assert [a.sharded for a in graph.io.inputs] == [a.sharded for a in graph.io.outputs]
    assert [a.sharded for a in graph.io.inputs] == [None, split]
    verify(graph)


def test_the_verifier_checks_the_interface():
    graph = parse(
        """\
func @step(%0: f32[4] donated loc("w"), %1: f32[4] loc("x")) {
  return %0 state=%1
}
"""
    )
    with pytest.raises(VerificationError, match=r"donates inputs \[0\], which are not state"):
        verify(graph)
    graph.io.inputs[0].donated, graph.io.outputs[0].state_of = False, 7
    with pytest.raises(VerificationError, match=r"the state of inputs \[7\] it does not have"):
        verify(graph)
    graph.io.outputs[0].state_of = None
    graph.io.outputs.append(OutputAttrs(rooted=True))  # a pass that adds no output
    with pytest.raises(VerificationError, match="interface has 2 inputs and 2 outputs"):
        verify(graph)
    graph.io.outputs.pop()
    graph.io.inputs[1].sharded = Split(1, ("x",))  # f32[4] has no dimension 1
    with pytest.raises(VerificationError, match="input 1 is held split on dimension 1"):
        verify(graph)
    graph.io.inputs[1].sharded = None
    graph.io.outputs[0].mirrored, graph.io.outputs[0].aggregation = True, "mean"
    with pytest.raises(VerificationError, match="declared both mirrored and aggregated"):
        verify(graph)


def test_printing_renumbers_values_canonically():
    text = LOOP.replace("%10", "%grad").replace("%2", "%x2")
    assert print_graph(parse(text)) == LOOP


def test_graph_helpers_count_and_walk():
    graph = parse(LOOP)
    assert graph.count_ops("jax.reduce_sum") == 1  # inside the scan region
    assert [n.op for n in graph.walk()][:4] == ["pvary", "all_reduce", "jax.scan", "constant"]
    assert graph.inputs[1].nbytes == 2 * 4 * 4
    assert graph.nodes[-1].outputs[0].nbytes == 16  # bf16


@pytest.mark.parametrize(
    ("text", "message", "line", "column"),
    [
        (
            "func @f(%0: f32[2]) {\n  %1: f32[2] = jax.neg(%9)\n  return %1\n}\n",
            "undefined value %9",
            2,
            24,
        ),
        (
            "func @f(%0: f32[2]) {\n  %0: f32[2] = jax.neg(%0)\n  return %0\n}\n",
            "defined twice",
            2,
            3,
        ),
        ("func @f(%0: f32[2) {\n  return %0\n}\n", "expected a type", 1, 13),
        (
            'func @f(%0: f32[2]) {\n  %1: f32[2] = jax.neg(%0) {"a": }\n  return %1\n}\n',
            "malformed attributes",
            2,
            34,
        ),
        ("func @f() {\n  return\n}\nextra", "unexpected text", 4, 1),
    ],
)
def test_parse_errors_name_line_and_column(text, message, line, column):
    with pytest.raises(IRParseError, match=message) as info:
        parse(text)
    assert (info.value.line, info.value.column) == (line, column)
    assert f"{line}:{column}:" in str(info.value)


def _graph_with(node: Node, inputs: list[Value]) -> Graph:
    return Graph(inputs=inputs, nodes=[node], outputs=list(node.outputs))


def test_verifier_rejects_use_before_definition():
    a = Value((2,), "float32")
    later = Value((2,), "float32")
    node = Node("jax.neg", [later], [Value((2,), "float32")])
    graph = Graph(inputs=[a], nodes=[node, Node("jax.neg", [a], [later])], outputs=[a])
    with pytest.raises(VerificationError, match="operand 0 is used before it is defined"):
        verify(graph)


def test_verifier_rejects_a_value_defined_twice():
    a = Value((2,), "float32")
    graph = Graph(inputs=[a], nodes=[Node("jax.neg", [a], [a])], outputs=[a])
    with pytest.raises(VerificationError, match="already defined"):
        verify(graph)


def test_verifier_rejects_unknown_collective_axis():
    x = Value((4,), "float32", frozenset({"replica"}))
    node = Node(
        "all_reduce",
        [x],
        [x.like(varying_axes=frozenset({"replica"}))],
        {"axes": ["batch"], "reduce_op": "sum"},
    )
    with pytest.raises(
        VerificationError, match=r"unknown mesh axis \['batch'\] \(mesh axes: replica\)"
    ):
        verify(_graph_with(node, [x]), MESH)


@pytest.mark.parametrize(
    ("op", "attrs", "out_shape", "message"),
    [
        ("all_reduce", {"axes": ["replica"], "reduce_op": "sum"}, (5,), "differs from operand"),
        ("all_reduce", {"axes": ["replica"], "reduce_op": "avg"}, (8,), "reduce_op must be one of"),
        ("reduce_scatter", {"axes": ["replica"], "dimension": 0}, (2,), r"should be \(1,\)"),
        ("all_gather", {"axes": ["replica"], "dimension": 0}, (8,), r"should be \(64,\)"),
        ("reshape", {}, (3, 3), "changes the element count"),
        ("slice", {"start": [0], "limit": [4]}, (3,), "does not match limit - start"),
        ("replica_slice", {"axes": ["replica"], "dimension": 0}, (2,), r"should be \(1,\)"),
    ],
)
def test_verifier_checks_known_op_shapes(op, attrs, out_shape, message):
    x = Value((8,), "float32", frozenset({"replica"}))
    out = Value(out_shape, "float32", frozenset() if op == "all_reduce" else frozenset({"replica"}))
    with pytest.raises(VerificationError, match=message):
        verify(_graph_with(Node(op, [x], [out], attrs), [x]), MESH)


def test_verifier_rejects_all_reduce_that_keeps_varying():
    x = Value((8,), "float32", frozenset({"replica"}))
    node = Node("all_reduce", [x], [x.like()], {"axes": ["replica"], "reduce_op": "sum"})
    with pytest.raises(VerificationError, match=r"result should vary over \[\]"):
        verify(_graph_with(node, [x]), MESH)


def test_verifier_checks_region_arity_and_isolation():
    graph = parse(LOOP)
    scan = graph.nodes[2]
    scan.regions[0].outputs.pop()
    with pytest.raises(
        VerificationError, match="region 0 takes 2 and returns 1 values, expected 2 and 2"
    ):
        verify(graph, MESH)
    # a region may not read a value of the enclosing graph
    graph = parse(LOOP)
    region = graph.nodes[2].regions[0]
    region.outputs[0] = graph.inputs[0]
    with pytest.raises(VerificationError, match="output 0 is not defined in this region"):
        verify(graph, MESH)


def test_collective_origins_are_one_of_the_known_ones():
    from xla_strategies.passes.ir.graph import Origin

    text = """\
func @step(%0: f32[4]{replica}) {
  %1: f32[4] = all_reduce(%0) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
  return %1
}
"""
    graph = parse(text)
    verify(graph, {"replica": 8})
    assert graph.nodes[0].attrs["origin"] == Origin.AUTODIFF
    with pytest.raises(VerificationError, match=r"unknown origin 'autodif'"):
        verify(parse(text.replace('"autodiff"', '"autodif"')), {"replica": 8})
