"""Running one pass on IR text, as the pass tests do: text in, text out."""

from __future__ import annotations

from xla_strategies.passes import Pass, PassContext, parse, print_graph, verify

MESH = {"replica": 8}


def run_pass(
    pass_: Pass, text: str, mesh: dict[str, int] = MESH, **context
) -> tuple[bool, str, PassContext]:
    """(changed, the IR after the pass, the pass context, made with `context`). The result
    must verify."""
    graph = parse(text)
    ctx = PassContext(mesh_axes=mesh, **context)
    changed = pass_.run(graph, ctx)
    verify(graph, mesh)
    return changed, print_graph(graph), ctx
