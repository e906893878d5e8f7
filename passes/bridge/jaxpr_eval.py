"""Running a captured jaxpr again in another program: the stage program of a pipeline.

`jax.core.eval_jaxpr` binds each equation as it was traced. In the stage program that
goes wrong three ways, each handled here:

- an equation's context and shardings name the mesh it was traced on, where the stage
  program is manual over the stage axis too: they are moved to the current mesh;
- a literal's own type names that mesh: it is read as a plain array of its dtype;
- the program's types are unchecked, and an equation with a body (a `scan`, `while`,
  `cond`, a rematerialised block) bound with its traced body keeps the traced varying
  types, which then disagree with a loop carry's: such bodies are re-emitted through
  `lax.scan`, `lax.while_loop`, `lax.switch` and `jax.checkpoint`, as the lowering
  re-emits regions, and a `pvary` adds only what JAX's own `pvary` would;
- a `jax.custom_jvp` or `jax.custom_vjp` call (`jax.nn.relu`, `jax.nn.softmax`) keeps its
  rule, but JAX runs the rule's jaxpr, traced for the captured mesh, with
  `core.eval_jaxpr`: its body and rule are run through `evaluate` instead.

Nested calls (`jit`) run inline.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from xla_strategies.core.patching import set_in_this_thread
from xla_strategies.passes.bridge import jax_compat
from xla_strategies.passes.bridge.replay import equation_context, recompute_inputs
from xla_strategies.passes.bridge.trace_hooks import vma
from xla_strategies.passes.stages.microbatch_draws import for_the_microbatch

#: call equations run inline
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


def evaluate(jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list:
    """The outputs of `jaxpr` on `args` (its constants `consts`), traced into the current
    program."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: np.asarray(v.val, v.aval.dtype) if isinstance(v, jex.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        rule = _RULES.get(eqn.primitive.name)
        outs = rule(eqn, invals) if rule is not None else _bound(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _bound(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    bound = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) before 0.12
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    with equation_context(eqn.ctx) as move:  # its shardings moved to this mesh
        outs = eqn.primitive.bind(*subfuns, *invals, **move(params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _body(closed: Any) -> Callable[..., list]:
    jaxpr, consts = jax_compat.jaxpr_parts(closed)
    return lambda *args: evaluate(jaxpr, consts, args)


def _call(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    return _body(eqn.params["jaxpr"])(*invals)


@contextlib.contextmanager
def unchecked_types() -> Iterator[None]:
    """While open, this thread's `evaluate` runs in a program whose types are unchecked (the
    lowering's `shard_map`, which names its own mesh's axes): a `pvary` is a no-op."""
    with set_in_this_thread(_types, "unchecked", True):
        yield


_types = threading.local()


def _pvary(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    """`pvary` as JAX's own runs it: over the axes a value does not vary over already, and
    not at all in a program whose types are unchecked."""
    from jax._src import core

    if getattr(_types, "unchecked", False):
        return list(invals)
    out = []
    for x in invals:
        missing = tuple(a for a in eqn.params["axes"] if a not in vma(x))
        out.append(core.pvary(x, missing) if missing else x)
    return out


def _scan(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    params = eqn.params
    num_consts, num_carry = jax_compat.scan_counts(params)
    consts, carry = invals[:num_consts], invals[num_consts : num_consts + num_carry]
    body = _body(params["jaxpr"])

    def step(carry: list, x: list) -> tuple[list, list]:
        outs = body(*consts, *carry, *x)
        return outs[:num_carry], outs[num_carry:]

    carry, ys = lax.scan(
        step,
        list(carry),
        list(invals[num_consts + num_carry :]),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


def _while(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    params = eqn.params
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    cond, body = _body(params["cond_jaxpr"]), _body(params["body_jaxpr"])
    return list(
        lax.while_loop(
            lambda c: cond(*cond_consts, *c)[0], lambda c: body(*body_consts, *c), list(init)
        )
    )


def _cond(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    branches = [_body(branch) for branch in eqn.params["branches"]]
    return list(lax.switch(invals[0], branches, *invals[1:]))


def _custom_jvp(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    """A custom_jvp call with its body and its rule run through `evaluate`: what JAX's
    `lift_jvp` does, with `evaluate` for `core.eval_jaxpr`."""
    num_consts, traced_rule = eqn.params["num_consts"], eqn.params["jvp_jaxpr_fun"]

    def jvp(*xs: Any) -> list[Any]:
        half = len(xs) // 2
        primals, tangents = xs[num_consts:half], xs[half + num_consts :]
        zeros = [isinstance(t, SymbolicZero) for t in tangents]
        with _as_captured(eqn):
            rule, rule_consts, out_zeros = traced_rule.call_wrapped(*zeros)
        nonzero = [t for t in tangents if not isinstance(t, SymbolicZero)]
        outs = evaluate(rule, rule_consts, [*primals, *nonzero])
        out_primals, out_tangents = outs[: len(out_zeros)], iter(outs[len(out_zeros) :])
        return [
            *out_primals,
            *(
                SymbolicZero(jax.typeof(p).to_tangent_aval()) if zero else next(out_tangents)
                for p, zero in zip(out_primals, out_zeros, strict=True)
            ),
        ]

    return _bound_with(eqn, invals, lambda _: (_wrapped(jvp, traced_rule),))


def _custom_vjp(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    """A custom_vjp call with its body and its forward rule run through `evaluate`: what
    JAX's `lift_fwd` does, with `evaluate` for `core.eval_jaxpr`. The backward rule is the
    user's function, traced when the gradient is."""
    num_consts, traced_fwd = eqn.params["num_consts"], eqn.params["fwd_jaxpr_thunk"]

    def fwd(*args: Any) -> list[Any]:
        values, nonzeros = args[::2], args[1::2]
        if any(nonzeros[:num_consts]):
            from jax._src.interpreters import ad

            raise ad.CustomVJPException()
        with _as_captured(eqn):
            forward, forward_consts = traced_fwd.call_wrapped(*nonzeros[num_consts:])
        return evaluate(forward, forward_consts, values[num_consts:])

    def unchecked(bwd: Any) -> Any:
        """The backward rule without JAX's check of its cotangents' types against the
        captured inputs': the check passed when the step was captured, on these shapes;
        here the stage program's types are unchecked and carry no varying axes."""
        from jax._src import config

        def run(*args: Any) -> Any:
            with config.disable_bwd_checks(True):
                return bwd.call_wrapped(*args)

        return _wrapped(run, bwd)

    return _bound_with(eqn, invals, lambda _, bwd: (_wrapped(fwd, traced_fwd), unchecked(bwd)))


@contextlib.contextmanager
def _as_captured(eqn: jex.JaxprEqn) -> Iterator[None]:
    """The context a custom rule's thunk traces the rule in: the one its call was captured
    in (its mesh, and checked varying types), as the thunk traces it for the avals of then."""
    from jax._src import config

    with eqn.ctx.manager, config._check_vma(True):
        yield


def _bound_with(eqn: jex.JaxprEqn, invals: list[Any], rules: Callable[..., tuple]) -> list[Any]:
    """`eqn` bound as JAX binds it, its body run through `evaluate` and its rules (the
    subfunctions after the body) replaced by `rules(*subfunctions)`."""
    params = dict(eqn.primitive.get_bind_params(eqn.params))
    body, *others = params["subfuns"]
    params["subfuns"] = (_wrapped(_body(eqn.params["call_jaxpr"]), body), *rules(*others))
    with equation_context(eqn.ctx) as move:
        return list(eqn.primitive.bind(*invals, **move(params)))


def _wrapped(fun: Callable[..., Any], like: Any) -> Any:
    """`fun` as the `WrappedFun` JAX binds, with the debug info of `like`."""
    from jax._src import linear_util

    return linear_util.wrap_init(fun, debug_info=like.debug_info)


def _remat(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    params = eqn.params
    if params["differentiated"]:  # the backward's recomputation: run as JAX runs it
        return _body(params["jaxpr"])(*recompute_inputs(invals, params["prevent_cse"]))
    fn = jax.checkpoint(
        _body(params["jaxpr"]), prevent_cse=params["prevent_cse"], policy=params["policy"]
    )
    return list(fn(*invals))


_RULES: dict[str, Callable[[jex.JaxprEqn, list[Any]], list[Any]]] = {
    **{name: _call for name in CALLS},
    "pvary": _pvary,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "remat2": _remat,
    "checkpoint": _remat,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    # a pipelined loss draws anew for each microbatch (`stages.microbatch_draws`)
    "random_bits": lambda eqn, invals: _bound(eqn, [for_the_microbatch(invals[0])]),
}
