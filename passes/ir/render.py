"""The IR as Graphviz dot (collectives highlighted, loop bodies as clusters) and as JSON."""

from __future__ import annotations

import json
from typing import Any

from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.text import format_type, value_names

_COLLECTIVE_STYLE = 'style=filled fillcolor="#f4a261"'
_KNOWN_STYLE = 'style=filled fillcolor="#e9f5db"'


def to_json(graph: Graph) -> dict[str, Any]:
    ids = value_names(graph)

    def value(v: Value) -> dict[str, Any]:
        out = {"id": ids[v], "type": format_type(v)}
        return out | ({"name": v.name} if v.name else {})

    def node(n: Node) -> dict[str, Any]:
        out = {
            "op": n.op,
            "inputs": [ids[v] for v in n.inputs],
            "outputs": [value(v) for v in n.outputs],
        }
        if n.attrs:
            out["attrs"] = n.attrs
        if n.created_by:
            out["created_by"] = n.created_by
        if n.regions:
            out["regions"] = [body(r) for r in n.regions]
        return out

    def body(g: Graph) -> dict[str, Any]:
        return {
            "inputs": [value(v) for v in g.inputs],
            "nodes": [node(n) for n in g.nodes],
            "outputs": [ids[v] for v in g.outputs],
        }

    return {"name": graph.name, **body(graph), "output_names": _output_names(graph)}


def to_dot(graph: Graph) -> str:
    """Graphviz source: one box per node, edges along values, regions as clusters."""
    ids = value_names(graph)
    lines = [
        f'digraph "{graph.name}" {{',
        "  rankdir=TB;",
        '  node [shape=box fontname="monospace"];',
    ]
    producer: dict[Value, str] = {}
    counter = [0]

    def emit(g: Graph, indent: str) -> None:
        for v in g.inputs:
            name = f"v{ids[v][1:]}"
            producer[v] = name
            label = f"{ids[v]}: {format_type(v)}" + (f"\\n{v.name}" if v.name else "")
            lines.append(f'{indent}{name} [shape=ellipse label="{_escape(label)}"];')
        for n in g.nodes:
            counter[0] += 1
            name = f"n{counter[0]}"
            style = _COLLECTIVE_STYLE if n.is_collective else "" if n.is_foreign else _KNOWN_STYLE
            label = f"{n.op}\\n" + ", ".join(format_type(v) for v in n.outputs)
            lines.append(f'{indent}{name} [label="{_escape(label)}" {style}];')
            for v in n.inputs:
                if v in producer:
                    lines.append(f"{indent}{producer[v]} -> {name};")
            for k, region in enumerate(n.regions):
                lines.append(f"{indent}subgraph cluster_{name}_{k} {{")
                lines.append(f'{indent}  label="{n.op} region {k}"; style=dashed;')
                emit(region, indent + "  ")
                lines.append(f"{indent}}}")
            for v in n.outputs:
                producer[v] = name

    emit(graph, "  ")
    lines.append('  outputs [shape=doubleoctagon label="return"];')
    lines += [f"  {producer[v]} -> outputs;" for v in graph.outputs if v in producer]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace('"', '\\"')


def to_json_text(graph: Graph) -> str:
    return json.dumps(to_json(graph), indent=1) + "\n"


def _output_names(graph: Graph) -> list[str | None]:
    return [a.name for a in graph.interface.outputs] if graph.interface else []
