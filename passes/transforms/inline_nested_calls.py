"""inline-nested-calls: the user's nested `jax.jit` calls run inlined in the lowered program,
not called as functions.

The lowering calls each call site the passes left as imported as one function per callee,
as JAX lowers them (`passes/bridge/called_functions.py`). Which program XLA's compiler
makes better depends on the program, not the hardware alone (XLA's TPU compiler, v5e-256
and v5p-512, libtpu 0.0.50):

| step (calls / inlined) | GiB/chip | estimated step ms |
|---|---|---|
| Hugging Face's GPT-2 medium, v5p-512, 98 calls of `jnp.var` | 14.63 / 16.70 | 70.32 / 70.61 |
| plain-JAX Llama-2-7B, parameters sharded, v5e-256 | 4.52 / 4.31 | 875.81 / 874.98 |

and on GPUs the plain-JAX GPT-2 medium's step on a DGX H100 node reads 4.7 % longer with
the calls (135.83 against 129.76 ms, the same memory; read 2026-12-01). So `mode=auto`
inlines them for GPUs only, and a step compiled for a known topology tries `mode=on` by compiling it
(`select_by_compiling`), keeping it where XLA's compile says it is better.

The IR's text is the same before and after: what changes is the mark each node of a call
carries (`Node.call`, which the text does not show). Before, a call of a jitted `norm`
lowers as `call @norm(...)` of one `func.func private @norm`; after, as its operations.
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_strategies.passes.base import ModePass, PassContext
from xla_strategies.passes.bridge.called_functions import calls_kept, inline_calls
from xla_strategies.passes.ir.graph import Graph


@dataclass(frozen=True)
class InlineNestedCalls(ModePass):
    """Options:
    mode: ``on`` inlines every nested call; ``auto`` those of a program for GPUs.
    """

    name = "inline-nested-calls"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if self.mode == "auto" and calls_kept(ctx.platform):
            return self.stays_off(
                ctx, {"inlined": 0}, f"XLA's compiler for {ctx.platform} keeps the calls"
            )
        inlined = inline_calls(graph)
        ctx.stats[self.name] = {"inlined": inlined}
        return inlined > 0
