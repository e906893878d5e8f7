"""Capture: trace a per-replica step into the IR.

The step is traced with `jax.make_jaxpr` inside `jax.shard_map(check_vma=True)` on the
concrete mesh's abstract mesh. JAX's varying-axes types then place a reduction exactly where
a mirrored value's gradient is complete: the transpose of `pvary` is `psum_invariant`.
While tracing, `trace_hooks` marks those reductions (so the importer can tell them from
the ones the user wrote, also inside loop bodies) and the gradients MEAN must scale.

Importing: collectives become first-class nodes, `pvary` a varying-type change, `jit` and
custom_jvp/vjp calls are inlined (autodiff has already happened), `scan`, `while`, `cond`
and `remat2` keep their bodies as regions, and everything else becomes a foreign node that
carries its equation for the lowering. Only this module, `trace_hooks`, `lowering` and
`jax_compat` (all in `passes/bridge/`) touch JAX internals; what differs between the JAX
releases the package supports is read in `jax_compat`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from xla_strategies.core.layout import model_dim, replica_axes
from xla_strategies.passes.bridge import jax_compat
from xla_strategies.passes.bridge.axis_names import (
    AxisRenamer,
    diagnose_unknown_axis,
)
from xla_strategies.passes.bridge.called_functions import mark_call_site
from xla_strategies.passes.bridge.equations import (
    RESHAPING,
    axis_names,
    ir_value,
    jsonable,
    policy_name,
    user_frames,
    user_source,
)
from xla_strategies.passes.bridge.layouts import manual_over, replica_spec
from xla_strategies.passes.bridge.loop_carries import varying_loop_carries
from xla_strategies.passes.bridge.step_mesh import diagnose_foreign_mesh
from xla_strategies.passes.bridge.trace_hooks import (
    AUTODIFF_SCOPE,
    GRADIENT_AXES,
    REPLICA_BLOCK_AXES,
    STAGE_SPLIT_SCOPE,
    marking_gradient_scales,
    matching_operand_types,
    pallas_kernels_per_replica,
    summing_custom_vjp_cotangents,
    tagging_autodiff_reductions,
)
from xla_strategies.passes.ir.graph import (
    DEFERRED,
    Graph,
    InputAttrs,
    Interface,
    Node,
    Origin,
    OutputAttrs,
    Value,
)

_INLINE = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}
#: of those, the calls JAX lowers as calls of a function, which the lowering calls again
#: (`called_functions`)
_CALLED = {"jit", "pjit"}
_REDUCE = {"psum": "sum", "psum_invariant": "sum", "pmax": "max", "pmin": "min"}
_GATHERS = {"all_gather", "all_gather_invariant"}
_SMALL_CONSTANT = 8  # constants up to this many elements print their value in the IR


def _without_dead_code(jaxpr: jex.Jaxpr) -> jex.Jaxpr:
    """`jaxpr` without the equations no output needs and that have no effect, as XLA
    removes them: the IR, its cost and the passes then see the program that runs. (A
    library that builds its model anew in each call, as flax's bridge from NNX modules to
    linen does, initializes every parameter in the trace, then uses the ones it is given.)
    Every input stays, unused or not: the step's signature is the IR's."""
    from jax._src.interpreters import partial_eval as pe

    live, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    return jaxpr.replace(eqns=live.eqns, outvars=live.outvars)


def capture(
    fn: Callable[..., Sequence[Any]],
    flat_args: Sequence[jax.ShapeDtypeStruct],
    mesh: Mesh,
    per_replica: Sequence[bool],
    *,
    stacked: Sequence[bool] = (),
    rename: Mapping[str, Sequence[str]] | None = None,
    input_names: Sequence[str] = (),
    name: str = "step",
) -> Graph:
    """Trace `fn(*flat_args)` per replica and import it.

    Args:
        fn: the user's per-replica step on flat arrays, returning a flat sequence of arrays.
        flat_args: global shapes and dtypes of the flattened arguments.
        mesh: the capture mesh; its replica axes (all but a model axis) together form the
            replica axis. A model axis is left to XLA's partitioner: the step sees values
            whole over it, and lays them out with sharding constraints.
        per_replica: per flat argument, whether it differs across replicas.
        stacked: per flat argument, whether it is stacked (one row per replica, which the
            step sees without the leading axis) rather than a batch split on dim 0.
        rename: capture-mesh axis name -> the strategy's axes it stands for (a step
            compiled with `axis_name=`); the IR only ever names the strategy's axes.
        input_names: pytree paths of the flat arguments, for the IR and errors.
        name: the graph's name.
    """
    specs = tuple(replica_spec(mesh) if split else PartitionSpec() for split in per_replica)
    squeeze = list(stacked) or [False] * len(flat_args)
    box: dict[str, Any] = {}

    def body(*flat):
        views = [x[0] if s else x for x, s in zip(flat, squeeze, strict=True)]
        box["jaxpr"] = jax.make_jaxpr(lambda *a: list(fn(*a)))(*views)
        return ()

    traced = jax.shard_map(
        body,
        mesh=mesh.abstract_mesh,
        in_specs=specs,
        out_specs=(),
        check_vma=True,
        **manual_over(mesh),
    )
    try:
        with (
            tagging_autodiff_reductions(),
            marking_gradient_scales(),
            varying_loop_carries(),
            matching_operand_types(),
            pallas_kernels_per_replica(replica_axes(mesh.axis_names)),
            summing_custom_vjp_cotangents(),
        ):
            jax.make_jaxpr(traced)(*flat_args)
    except (AssertionError, NameError) as exc:
        diagnose_unknown_axis(
            lambda: jax.make_jaxpr(traced)(*flat_args), tuple(mesh.axis_names), exc
        )
        raise
    except ValueError as exc:
        diagnose_foreign_mesh(name, mesh, exc)
        raise
    jaxpr, consts = jax_compat.jaxpr_parts(box["jaxpr"])
    jaxpr = _without_dead_code(jaxpr)
    importer = _Importer(AxisRenamer(rename or {}))
    graph = importer.graph(jaxpr, consts, name)
    for value, label in zip(graph.inputs, input_names, strict=False):
        value.name = label
    importer.name_parameters()
    graph.interface = Interface(
        [InputAttrs(stacked=s) for s in squeeze], [OutputAttrs() for _ in graph.outputs]
    )
    return graph


class _Importer:
    """Turns a jaxpr into IR, one region per nested loop or branch body."""

    def __init__(self, renamer: AxisRenamer) -> None:
        self._renamer = renamer
        # call stack -> (parameter, the value made varying there: it or a reshape of it)
        self._uses: dict[tuple, list[tuple[Value, Value]]] = {}
        self._roots: dict[Value, Value] = {}  # a reshaped value -> the value it reshapes
        self._reductions: list[tuple[tuple, Node]] = []
        self._inlining = 0  # how deep in inlined calls the importer is

    def value(self, aval: Any) -> Value:
        return self._renamer.value(ir_value(aval))

    def axes(self, params: dict[str, Any]) -> list[str]:
        return self._renamer.names(axis_names(params))

    def name_parameters(self) -> None:
        """Give each autodiff reduction the pytree path of its parameter, when exactly one
        step input of its size was made varying at the same call stack."""
        for stack, node in self._reductions:
            size = node.inputs[0].size  # the gradient of what was made varying
            uses = self._uses.get(stack, [])
            names = {root.name for root, used in uses if root.name and used.size == size}
            if len(names) == 1:
                node.attrs["param"] = names.pop()

    def graph(self, jaxpr: jex.Jaxpr, consts: Sequence[Any], name: str) -> Graph:
        graph = Graph(
            inputs=[self.value(v.aval) for v in jaxpr.invars], nodes=[], outputs=[], name=name
        )
        graph.outputs = self.emit(graph, jaxpr, consts, graph.inputs)
        return graph

    def emit(
        self, graph: Graph, jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Value]
    ) -> list[Value]:
        """Append `jaxpr`'s equations to `graph`, reading `args`; return its output values."""
        env: dict[Any, Value] = dict(zip(jaxpr.invars, args, strict=True))
        for var, const in zip(jaxpr.constvars, consts, strict=True):
            env[var] = self.constant(graph, const, var.aval)

        def read(atom: Any) -> Value:
            if isinstance(atom, jex.Literal):
                return self.constant(graph, atom.val, atom.aval)
            return env[atom]

        for eqn in jaxpr.eqns:
            inputs = [read(v) for v in eqn.invars]
            outputs = self.equation(graph, eqn, inputs)
            env.update(zip(eqn.outvars, outputs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    def constant(self, graph: Graph, value: Any, aval: Any) -> Value:
        out = ir_value(aval)
        shown = "elided"
        if not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):  # a PRNG key has no
            array = np.asarray(value)  # numpy form
            if array.size <= _SMALL_CONSTANT and array.dtype.kind in "biuf":
                shown = array.tolist()
        graph.nodes.append(Node("constant", [], [out], {"value": shown}, payload=value))
        return out

    def equation(self, graph: Graph, eqn: jex.JaxprEqn, inputs: list[Value]) -> list[Value]:
        prim, params = eqn.primitive.name, eqn.params
        if prim in _INLINE:
            sub = params.get("jaxpr", params.get("call_jaxpr", params.get("fun_jaxpr")))
            first = len(graph.nodes)
            self._inlining += 1
            try:
                outputs = self.emit(graph, *jax_compat.jaxpr_parts(sub), inputs)
            finally:
                self._inlining -= 1
            if not self._inlining and prim in _CALLED and jax_compat.lowered_as_call(params):
                name = str(params.get("name", "call"))
                mark_call_site(graph.nodes[first:], sub, name, inputs, outputs)
            return outputs
        if prim == "pvary" and REPLICA_BLOCK_AXES.search(str(eqn.source_info.name_stack)):
            return inputs  # `replica_slice` takes the mirrored stack itself
        outputs = [self.value(v.aval) for v in eqn.outvars]
        node = self.known_node(eqn, inputs, outputs) or self.region_node(eqn, inputs, outputs)
        if node is None:
            attrs = {k: j for k, v in params.items() if (j := jsonable(v)) is not None}
            if prim == "sharding_constraint":
                attrs |= _constraint_attrs(params)
            node = Node("jax." + prim, inputs, outputs, attrs, payload=self._renamer.equation(eqn))
        graph.nodes.append(node)
        if prim in RESHAPING and len(inputs) == 1:
            self._roots[outputs[0]] = self._roots.get(inputs[0], inputs[0])
        return outputs

    def known_node(
        self, eqn: jex.JaxprEqn, inputs: list[Value], outputs: list[Value]
    ) -> Node | None:
        prim, params = eqn.primitive.name, eqn.params
        if params.get("axis_index_groups") is not None:
            return None  # grouped collectives stay opaque
        if prim in _REDUCE:
            autodiff = AUTODIFF_SCOPE in str(eqn.source_info.name_stack)
            origin = Origin.AUTODIFF if autodiff else Origin.USER
            attrs = {"axes": self.axes(params), "reduce_op": _REDUCE[prim], "origin": origin}
            if STAGE_SPLIT_SCOPE in str(eqn.source_info.name_stack):
                attrs["stage_split"] = True  # kept out of buckets and decompositions
            source = user_source(eqn)
            if source:
                attrs["source"] = source
            node = Node("all_reduce", inputs, outputs, attrs)
            if origin is Origin.AUTODIFF and len(inputs) == 1:
                self._reductions.append((user_frames(eqn), node))
            return node
        if prim == "mul" and (marked := GRADIENT_AXES.search(str(eqn.source_info.name_stack))):
            axes = self._renamer.names(marked.group(1).split(","))
            attrs = {"axes": axes, "factor": 1, "origin": Origin.GRADIENT}
            return Node("scale", inputs[:1], outputs, attrs)
        if prim == "axis_index":  # renamed axes may be several: a tuple binds no primitive
            return Node("axis_index", inputs, outputs, {"axes": self.axes(params)})
        if prim == "pvary":
            uses = [(self._roots.get(v, v), v) for v in inputs]
            self._uses.setdefault(user_frames(eqn), []).extend(uses)
            return Node("pvary", inputs, outputs, {"axes": self.axes(params)})
        block_axes = REPLICA_BLOCK_AXES.search(str(eqn.source_info.name_stack))
        if prim in _GATHERS and params.get("tiled"):
            attrs = {"axes": self.axes(params), "dimension": params["all_gather_dimension"]}
            if block_axes:  # a pipelined stack's gradient, whole only where read whole
                attrs[DEFERRED] = True
            return Node("all_gather", inputs, outputs, attrs)
        if prim == "dynamic_slice" and block_axes:  # this replica's block of a stack
            axes = self._renamer.names(block_axes.group(1).split(","))
            return Node(
                "replica_slice", inputs[:1], outputs, {"axes": axes, "dimension": _cut(eqn)}
            )
        if prim == "reduce_scatter" and params.get("tiled"):
            attrs = {
                "axes": self.axes(params),
                "dimension": params["scatter_dimension"],
                "reduce_op": "sum",
            }
            return Node("reduce_scatter", inputs, outputs, attrs)
        if prim == "ppermute":
            attrs = {"axes": self.axes(params), "perm": jsonable(params["perm"])}
            return Node("collective_permute", inputs, outputs, attrs)
        if prim == "all_to_all" and params.get("tiled"):
            attrs = {
                "axes": self.axes(params),
                "split_axis": params["split_axis"],
                "concat_axis": params["concat_axis"],
            }
            return Node("all_to_all", inputs, outputs, attrs)
        return None

    def region_node(
        self, eqn: jex.JaxprEqn, inputs: list[Value], outputs: list[Value]
    ) -> Node | None:
        prim, params = eqn.primitive.name, eqn.params
        counts: dict[str, Any] = {}
        if prim == "scan":
            num_consts, num_carry = jax_compat.scan_counts(params)
            counts = {"num_consts": num_consts, "num_carry": num_carry}
            keys = ("length", "reverse", "unroll")
            bodies = [params["jaxpr"]]
        elif prim == "while":
            keys = ("cond_nconsts", "body_nconsts")
            bodies = [params["cond_jaxpr"], params["body_jaxpr"]]
        elif prim == "cond":
            keys, bodies = (), list(params["branches"])
        elif prim == "remat2":
            keys = ("prevent_cse", "differentiated")
            bodies = [params["jaxpr"]]
        else:
            return None
        attrs = {**counts, **{k: jsonable(params[k]) for k in keys}}
        if prim == "remat2" and params.get("policy") is not None:
            attrs["policy"] = policy_name(params["policy"])
        regions = [
            self.graph(*jax_compat.jaxpr_parts(body), f"{prim}.region{i}")
            for i, body in enumerate(bodies)
        ]
        return Node("jax." + prim, inputs, outputs, attrs, regions=regions, payload=eqn)


def _cut(eqn: jex.JaxprEqn) -> int:
    """The dimension a slice equation cuts (the one its result is smaller on)."""
    whole, part = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    return next(d for d, (a, b) in enumerate(zip(whole, part, strict=True)) if a != b)


def _constraint_attrs(params: dict[str, Any]) -> dict[str, int]:
    """A sharding constraint's `model_dim`: the dimension its sharding splits over the
    model axis (flax's `nn.with_partitioning`, Megatron's activation constraints), where
    it splits one. Autodiff transposes a parameter's constraint into its gradient's, so the
    gradient's reduction finds its parameter's layout there (`layouts.mark_model_dims`)."""
    dim = model_dim(getattr(params.get("sharding"), "spec", ()))
    return {} if dim is None else {"model_dim": dim}
