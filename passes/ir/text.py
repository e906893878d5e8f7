"""The IR's text form: a deterministic printer and a parser that reads it back.

    func @step(%0: f32[4,3] loc("args[0]['w']"), %1: f32[2,4]{replica}) {
      %2: f32[4,3]{replica} = pvary(%0) {"axes": ["replica"]}
      %3: f32[4,3] = all_reduce(%2) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
      %4: f32[] = jax.scan(%1) {"length": 2, "num_carry": 0, "num_consts": 1}
        region (%5: f32[2,4]{replica}) {
          return %5
        }
      return %3 mirrored loc("out[0]")
    }

Flags after a value: on a function input, `stacked` (one value per replica, stacked outside
the step, rather than a split batch); on a returned value, `mirrored` (declared so),
`aggregate=<op>` (declared aggregated), `rooted` (correct on the root replica only) and
`state=%K` (the next value of input K). On both, `sharded=D{axes}`: a mirrored value held
split on dimension D across the replicas between steps, its blocks numbered over the axes
in that order; its type is one replica's block. `model=D`: a mirrored value split on
dimension D over the model axis, inside each replica (XLA's partitioner lays it out; the
graph sees it whole).

Values are renumbered in definition order on printing, so `print(parse(text)) == text` for
any printed text. Attributes are JSON. `// by <pass>` records the pass that made a node.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from xla_strategies.passes.ir.graph import (
    Graph,
    InputAttrs,
    Interface,
    Node,
    OutputAttrs,
    Split,
    Value,
    long_dtype,
    short_dtype,
)

_INDENT = "  "


# printing


def format_type(value: Value) -> str:
    dims = ",".join(str(d) for d in value.shape)
    axes = "{" + ",".join(sorted(value.varying_axes)) + "}" if value.varying_axes else ""
    return f"{short_dtype(value.dtype)}[{dims}]{axes}"


def _loc(name: str | None) -> str:
    return f" loc({json.dumps(name)})" if name else ""


class _Printer:
    def __init__(self) -> None:
        self.names: dict[Value, str] = {}
        self.lines: list[str] = []

    def define(self, value: Value) -> str:
        name = self.names[value] = f"%{len(self.names)}"
        return f"{name}: {format_type(value)}"

    def use(self, value: Value) -> str:
        return self.names.get(value, "%<undefined>")

    def body(self, graph: Graph, depth: int) -> None:
        pad = _INDENT * depth
        for node in graph.nodes:
            results = ", ".join(self.define(v) for v in node.outputs)
            head = f"{results} = " if results else ""
            args = ", ".join(self.use(v) for v in node.inputs)
            attrs = f" {json.dumps(node.attrs, sort_keys=True)}" if node.attrs else ""
            by = f"  // by {node.created_by}" if node.created_by else ""
            self.lines.append(f"{pad}{head}{node.op}({args}){attrs}{by}")
            for region in node.regions:
                params = ", ".join(self.define(v) + _loc(v.name) for v in region.inputs)
                self.lines.append(f"{pad}{_INDENT}region ({params}) {{")
                self.body(region, depth + 2)
                self.lines.append(f"{pad}{_INDENT}}}")
        attrs = graph.interface.outputs if graph.interface else [None] * len(graph.outputs)
        returns = [
            f"{self.use(value)}{_output_flags(a)}{_loc(a.name if a else None)}"
            for value, a in zip(graph.outputs, attrs, strict=True)
        ]
        self.lines.append(f"{pad}return {', '.join(returns)}".rstrip())


def _output_flags(a: OutputAttrs | None) -> str:
    if a is None:
        return ""
    return (
        (" mirrored" if a.mirrored else "")
        + (f" aggregate={a.aggregation}" if a.aggregation else "")
        + (" rooted" if a.rooted else "")
        + (f" state=%{a.state_of}" if a.state_of is not None else "")
        + (f" sharded={a.sharded}" if a.sharded else "")
        + (f" model={a.model_dim}" if a.model_dim is not None else "")
        + (" stages" if a.stage_split else "")
    )


def _printed(graph: Graph) -> _Printer:
    printer = _Printer()
    attrs = graph.interface.inputs if graph.interface else [InputAttrs()] * len(graph.inputs)
    params = ", ".join(
        printer.define(v)
        + (" stacked" if a.stacked else "")
        + (f" sharded={a.sharded}" if a.sharded else "")
        + (f" model={a.model_dim}" if a.model_dim is not None else "")
        + (" stages" if a.stage_split else "")
        + (" donated" if a.donated else "")
        + _loc(v.name)
        for v, a in zip(graph.inputs, attrs, strict=True)
    )
    printer.lines.append(f"func @{graph.name}({params}) {{")
    printer.body(graph, 1)
    printer.lines.append("}")
    return printer


def print_graph(graph: Graph) -> str:
    """The text form of `graph`, ending in a newline."""
    return "\n".join(_printed(graph).lines) + "\n"


def value_names(graph: Graph) -> dict[Value, str]:
    """Each value's name in the text form (`%3`), so other renderings agree with it."""
    return _printed(graph).names


# parsing


class IRParseError(ValueError):
    """Malformed IR text; the message names the line and column."""

    def __init__(self, message: str, line: int, column: int, source_line: str) -> None:
        super().__init__(f"{line}:{column}: {message}\n  {source_line}\n  {' ' * (column - 1)}^")
        self.line, self.column = line, column


_BLANKS = re.compile(r"\s*")
_COMMENT = re.compile(r"//[^\n]*")
_IDENT = re.compile(r"[A-Za-z_][\w.\-]*")
_VALUE = re.compile(r"%[\w.\-]+")
_INT = re.compile(r"\d+")
# a dtype is a word, or a PRNG key's `key<impl>` (`key<fry>`: threefry)
_TYPE = re.compile(r"([A-Za-z0-9_]+(?:<\w+>)?)\[([0-9,\s]*)\](?:\{([\w,\s\-]*)\})?")


@dataclass
class _Cursor:
    text: str
    pos: int = 0

    def error(self, message: str) -> IRParseError:
        line = self.text.count("\n", 0, self.pos) + 1
        start = self.text.rfind("\n", 0, self.pos) + 1
        end = self.text.find("\n", self.pos)
        source = self.text[start : end if end >= 0 else len(self.text)]
        return IRParseError(message, line, self.pos - start + 1, source)

    def skip(self) -> None:
        """Skip blanks; `// by` comments are syntax and stay, other `//` comments go."""
        while True:
            self.pos = _BLANKS.match(self.text, self.pos).end()
            if self.text.startswith("//", self.pos) and not self.text.startswith("// by", self.pos):
                self.pos = _COMMENT.match(self.text, self.pos).end()
                continue
            return

    def peek(self, literal: str) -> bool:
        self.skip()
        return self.text.startswith(literal, self.pos)

    def accept(self, literal: str) -> bool:
        if self.peek(literal):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str) -> None:
        if not self.accept(literal):
            found = self.text[self.pos : self.pos + 12].split("\n")[0] or "end of input"
            raise self.error(f"expected {literal!r}, found {found!r}")

    def match(self, pattern: re.Pattern[str], what: str) -> re.Match[str]:
        self.skip()
        found = pattern.match(self.text, self.pos)
        if not found:
            raise self.error(f"expected {what}")
        self.pos = found.end()
        return found

    def json(self, what: str):  # noqa: ANN201 - any JSON value
        self.skip()
        try:
            value, self.pos = json.JSONDecoder().raw_decode(self.text, self.pos)
        except json.JSONDecodeError as exc:
            self.pos = exc.pos
            raise self.error(f"malformed {what}: {exc.msg}") from None
        return value


class _Parser:
    def __init__(self, text: str) -> None:
        self.cur = _Cursor(text)

    def value_type(self) -> Value:
        found = self.cur.match(_TYPE, "a type such as f32[4,3]{replica}")
        dims = [d for d in found.group(2).replace(" ", "").split(",") if d]
        axes = [a.strip() for a in (found.group(3) or "").split(",") if a.strip()]
        return Value(tuple(int(d) for d in dims), long_dtype(found.group(1)), frozenset(axes))

    def define(self, scope: dict[str, Value]) -> Value:
        self.cur.skip()
        start = self.cur.pos
        name = self.cur.match(_VALUE, "a value name such as %3").group(0)
        if name in scope:
            self.cur.pos = start
            raise self.cur.error(f"value {name} is defined twice")
        self.cur.expect(":")
        value = scope[name] = self.value_type()
        return value

    def use(self, scope: dict[str, Value]) -> Value:
        self.cur.skip()
        start = self.cur.pos
        name = self.cur.match(_VALUE, "a value name such as %3").group(0)
        if name not in scope:
            self.cur.pos = start
            raise self.cur.error(f"use of undefined value {name}")
        return scope[name]

    def loc(self) -> str | None:
        if not self.cur.accept("loc("):
            return None
        name = self.cur.json("location string")
        self.cur.expect(")")
        return name

    def params(self, scope: dict[str, Value]) -> tuple[list[Value], list[InputAttrs]]:
        """The values a function or region takes, and what each is (`stacked`,
        `sharded=D{axes}`, `model=D`, `donated`)."""
        self.cur.expect("(")
        values: list[Value] = []
        attrs: list[InputAttrs] = []
        while not self.cur.accept(")"):
            if values:
                self.cur.expect(",")
            value = self.define(scope)
            a = InputAttrs(stacked=self.cur.accept("stacked"))
            if self.cur.accept("sharded="):
                a.sharded = self.split()
            if self.cur.accept("model="):
                a.model_dim = self.integer("a dimension")
            a.stage_split = self.cur.accept("stages")
            a.donated = self.cur.accept("donated")
            value.name = self.loc()
            values.append(value)
            attrs.append(a)
        return values, attrs

    def integer(self, what: str) -> int:
        return int(self.cur.match(_INT, what).group(0))

    def split(self) -> Split:
        """`D{axis,...}` after `sharded=`."""
        dim = self.integer("a dimension")
        self.cur.expect("{")
        axes = [self.cur.match(_IDENT, "a mesh axis").group(0)]
        while self.cur.accept(","):
            axes.append(self.cur.match(_IDENT, "a mesh axis").group(0))
        self.cur.expect("}")
        return Split(dim, tuple(axes))

    def graph(self) -> Graph:
        self.cur.expect("func")
        self.cur.expect("@")
        name = self.cur.match(_IDENT, "a function name").group(0)
        scope: dict[str, Value] = {}
        inputs, input_attrs = self.params(scope)
        graph, output_attrs = self.body(inputs, scope, name)
        graph.interface = Interface(input_attrs, output_attrs)
        self.cur.skip()
        if self.cur.pos != len(self.cur.text):
            raise self.cur.error("unexpected text after the function")
        return graph

    def body(
        self, inputs: list[Value], scope: dict[str, Value], name: str
    ) -> tuple[Graph, list[OutputAttrs]]:
        self.cur.expect("{")
        graph = Graph(inputs=inputs, nodes=[], outputs=[], name=name)
        while not self.cur.peek("return"):
            graph.nodes.append(self.node(scope))
        self.cur.expect("return")
        attrs: list[OutputAttrs] = []
        while not self.cur.accept("}"):
            if graph.outputs:
                self.cur.expect(",")
            graph.outputs.append(self.use(scope))
            a = OutputAttrs(mirrored=self.cur.accept("mirrored"))
            if self.cur.accept("aggregate="):
                a.aggregation = self.cur.match(_IDENT, "a reduction such as mean").group(0)
            a.rooted = self.cur.accept("rooted")
            if self.cur.accept("state=%"):
                a.state_of = self.integer("an input number")
            if self.cur.accept("sharded="):
                a.sharded = self.split()
            if self.cur.accept("model="):
                a.model_dim = self.integer("a dimension")
            a.stage_split = self.cur.accept("stages")
            a.name = self.loc()
            attrs.append(a)
        return graph, attrs

    def node(self, scope: dict[str, Value]) -> Node:
        outputs: list[Value] = []
        if self.cur.peek("%"):
            outputs.append(self.define(scope))
            while self.cur.accept(","):
                outputs.append(self.define(scope))
            self.cur.expect("=")
        op = self.cur.match(_IDENT, "an op name").group(0)
        self.cur.expect("(")
        inputs: list[Value] = []
        while not self.cur.accept(")"):
            if inputs:
                self.cur.expect(",")
            inputs.append(self.use(scope))
        attrs = self.cur.json("attributes") if self.cur.peek("{") else {}
        if not isinstance(attrs, dict):
            raise self.cur.error("attributes must be a JSON object")
        created_by = (
            self.cur.match(_IDENT, "a pass name").group(0) if self.cur.accept("// by") else None
        )
        node = Node(op, inputs, outputs, attrs, created_by=created_by)
        while self.cur.accept("region"):
            region_scope: dict[str, Value] = {}
            params, _ = self.params(region_scope)
            name = f"{op}.region{len(node.regions)}"
            node.regions.append(self.body(params, region_scope, name)[0])
        return node


def parse(text: str) -> Graph:
    """Parse the text form back into a `Graph`. Raises `IRParseError` with line and column."""
    return _Parser(text).graph()
