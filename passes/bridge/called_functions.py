"""The user's nested `jax.jit` calls, called again in the lowered program.

The importer inlines a nested `jax.jit` call into the step's graph, as the passes need.
JAX lowers each such call as a call of one function per callee (`func.call`), and XLA's
TPU compiler fuses and keeps buffers differently for a program that calls one function
from many places than for the same program flat. Hugging Face's GPT-2 medium, a plain
`shard_map` of its step on v5p-512: 14.63 GiB a chip with its 98 calls of `jnp.var`'s
`_var`, 16.70 with them inlined, or called as 98 functions of their own (XLA then fuses
the whole residual stream into one late fusion and keeps every block's output for it).

So the importer marks the nodes of each outermost call with its `CallSite`
(`mark_call_site`), and the lowering runs a site the passes left as it was imported
(`whole_site`) as a call of its callee's function, one function per callee
(`site_function`). A site holding anything a pass gives meaning to (a reduction, a
gradient's scale, a loop whose body a pass may rewrite, a sharding) is left inlined.

Not for GPUs (`calls_kept`): XLA's GPU compiler fuses less across the calls, and the
plain-JAX GPT-2 medium's step on a DGX H100 node reads 4.7 % longer with them (135.83
against 129.76 ms, the same memory). Nor where the `inline-nested-calls` pass unmarked
the sites (`inline_calls`): a step compiled for a topology tries that by compiling it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from xla_strategies.passes.bridge import jax_compat
from xla_strategies.passes.bridge.jaxpr_eval import evaluate, unchecked_types
from xla_strategies.passes.ir.graph import Graph, Node, Value

#: foreign primitives a call site must not hold: each names the capture's mesh
_NOT_CALLED = frozenset({"sharding_constraint", "mesh_cast", "reshard"})


@dataclass(eq=False)
class CallSite:
    """One call of a jitted function, as imported: the callee (the jaxpr every call of the
    function shares), its name, the values it took and gave, and the nodes the importer
    made of it with each one's wiring (inputs, outputs, attributes) then."""

    callee: Any
    name: str
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    nodes: tuple[Node, ...]
    wiring: tuple[tuple[tuple[Value, ...], tuple[Value, ...], dict[str, Any]], ...]


def mark_call_site(
    nodes: Sequence[Node],
    callee: Any,
    name: str,
    inputs: Sequence[Value],
    outputs: Sequence[Value],
) -> None:
    """Mark `nodes` (all the importer made of one call of `callee`) as that call's site,
    where every node is one a call can run as imported."""
    if not nodes or not all(_callable(node) for node in nodes):
        return
    wiring = tuple((tuple(n.inputs), tuple(n.outputs), dict(n.attrs)) for n in nodes)
    site = CallSite(callee, name, tuple(inputs), tuple(outputs), tuple(nodes), wiring)
    for node in nodes:
        node.call = site


def _callable(node: Node) -> bool:
    if node.op in ("constant", "pvary"):
        return True
    return node.is_foreign and not node.regions and node.primitive not in _NOT_CALLED


def calls_kept(platform: str) -> bool:
    """Whether a program for devices of `platform` calls its sites again (not on GPUs)."""
    return platform not in ("gpu", "cuda", "rocm")


def call_sites(graph: Graph) -> int:
    """How many call sites `graph` (its regions' too) still marks."""
    return len({id(node.call) for node in graph.walk() if node.call is not None})


def sites_called(graph: Graph, platform: str) -> int:
    """The call sites `graph` still marks where its lowering for `platform` keeps calls
    (none for GPUs): with its text, what tells two programs the passes left apart."""
    return call_sites(graph) if calls_kept(platform) else 0


def inline_calls(graph: Graph) -> int:
    """Unmark every call site of `graph` (its regions' too), so each runs inlined; returns
    how many there were."""
    sites = call_sites(graph)
    for node in graph.walk():
        node.call = None
    return sites


def whole_site(nodes: Sequence[Node], at: int) -> CallSite | None:
    """The call site `nodes[at:]` begins with, where the passes left every one of its nodes
    in place and as imported; None otherwise (its nodes run one by one)."""
    site: CallSite | None = nodes[at].call
    if site is None or site.nodes[0] is not nodes[at]:
        return None
    here = nodes[at : at + len(site.nodes)]
    if len(here) != len(site.nodes):
        return None
    if any(a is not b for a, b in zip(here, site.nodes, strict=True)):
        return None
    now = [(tuple(n.inputs), tuple(n.outputs), n.attrs) for n in site.nodes]
    return site if now == list(site.wiring) else None


def site_function(site: CallSite, callees: dict[Any, Callable[..., Any]]) -> Callable[..., Any]:
    """The jitted function that runs `site`'s callee: one per callee in `callees` (a
    program's own), so every call of it calls the same function, as JAX lowers them."""
    found = callees.get(site.callee)
    if found is None:
        jaxpr, consts = jax_compat.jaxpr_parts(site.callee)

        def called(*args: Any) -> list[Any]:
            with unchecked_types():  # the lowering's program, as the IR's `pvary` nodes
                return evaluate(jaxpr, consts, args)

        called.__name__ = site.name
        found = callees[site.callee] = jax.jit(called)
    return found
