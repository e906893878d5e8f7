"""The JAX frontend's op table: the traits of each JAX primitive the capture imports as a
foreign op `jax.<primitive>`. The only place passes learn what a JAX primitive does."""

from __future__ import annotations

from xla_strategies.passes.traits import Trait, declare, declare_all


def _jax(*names: str) -> list[str]:
    return [f"jax.{name}" for name in names]


declare_all(
    _jax("transpose", "reshape", "squeeze", "expand_dims", "neg", "copy", "copy_p", "reduce_sum"),
    Trait.LINEAR,
)
declare("jax.mul", Trait.SCALING, Trait.ELEMENTWISE)
declare("jax.div", Trait.DIVIDING, Trait.ELEMENTWISE)
declare_all(_jax("add", "add_any"), Trait.ADDING, Trait.ELEMENTWISE)
declare_all(
    _jax(
        "sub",
        "max",
        "min",
        "exp",
        "log",
        "tanh",
        "sin",
        "cos",
        "logistic",
        "integer_pow",
        "sqrt",
        "rsqrt",
        "abs",
        "sign",
        "select_n",
        "convert_element_type",
        "pow",
    ),
    Trait.ELEMENTWISE,
)
declare("jax.scan", Trait.COUNTED_LOOP)
declare("jax.while", Trait.WHILE_LOOP)
declare("jax.remat2", Trait.CALL_ONCE)
declare("jax.cond", Trait.BRANCHES)
declare("jax.dot_general", Trait.CONTRACTION)
declare_all(_jax("debug_callback", "io_callback", "pure_callback"), Trait.SIDE_EFFECT)
