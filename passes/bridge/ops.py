"""The JAX frontend's op table: the traits of each JAX primitive the capture imports as a
foreign op `jax.<primitive>`. The only place passes learn what a JAX primitive does."""

from __future__ import annotations

from xla_strategies.passes.ir.traits import (
    Trait,
    declare,
    declare_all,
    declare_dimension_reduction,
    declare_result_shape_param,
)


def _jax(*names: str) -> list[str]:
    return [f"jax.{name}" for name in names]


declare_all(_jax("squeeze", "expand_dims"), Trait.LINEAR)
declare("jax.transpose", Trait.LINEAR, Trait.TRANSPOSE)
declare("jax.reshape", Trait.LINEAR, Trait.RESHAPE)
declare_result_shape_param("jax.reshape", "new_sizes")
declare_all(_jax("neg", "copy", "copy_p"), Trait.LINEAR, Trait.ELEMENTWISE)
# a layout over the model axis, the identity on values: it runs on a replica's block
# as on the whole value (the block is never cut on the model axis's dimension)
declare("jax.sharding_constraint", Trait.LINEAR, Trait.ELEMENTWISE)
declare_dimension_reduction("jax.reduce_sum", "sum", Trait.LINEAR)
declare_dimension_reduction("jax.reduce_max", "max")
declare_dimension_reduction("jax.reduce_min", "min")
declare("jax.broadcast_in_dim", Trait.BROADCAST_IN_DIM)
declare_result_shape_param("jax.broadcast_in_dim", "shape")
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
        "pow",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "and",
        "or",
        "not",
        "is_finite",
        "square",
        "log1p",
        "expm1",
        "erf",
        "nextafter",
        "clamp",
        "floor",
        "ceil",
        "round",
        "rem",
        "one_minus_square",  # tanh's derivative, 1 - x**2, a primitive of its own in JAX 0.12
        "exp2",
        "tan",
        "atan2",
        "erf_inv",
        "erfc",
        "cbrt",
    ),
    Trait.ELEMENTWISE,
)
declare("jax.convert_element_type", Trait.CAST, Trait.ELEMENTWISE)
declare("jax.all_gather", Trait.GATHERS)
declare("jax.gather", Trait.LOOKUP)
declare("jax.scatter-add", Trait.SCATTER_ADD)
declare("jax.scan", Trait.COUNTED_LOOP)
declare("jax.while", Trait.WHILE_LOOP)
declare("jax.remat2", Trait.CALL_ONCE)
declare("jax.cond", Trait.BRANCHES)
declare("jax.dot_general", Trait.CONTRACTION)
declare("jax.conv_general_dilated", Trait.CONVOLUTION)
declare_all(_jax("debug_callback", "io_callback", "pure_callback"), Trait.SIDE_EFFECT)
