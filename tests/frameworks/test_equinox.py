"""equinox, as its docs write it: the module is an argument and comes back updated,
`filter_value_and_grad`, and optax on `eqx.filter(model, eqx.is_array)`."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import xla_strategies as xs
from tests.frameworks.reference import assert_trees_close, distribute, regression_batches

optim = optax.adam(1e-2)


@eqx.filter_value_and_grad
def compute_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_step(model, opt_state, x, y):
    loss, grads = compute_loss(model, x, y)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def _train(model, batches, **options):
    """`make_step` compiled on a MirroredStrategy with `options`, and under
    `eqx.filter_jit` on one device, from `model`: (ours, the reference's, the strategy,
    the compiled step), each `(model, opt_state, loss)` after the last batch."""
    strategy = xs.MirroredStrategy()
    step = strategy.compile(make_step, **options)
    reference = eqx.filter_jit(make_step)
    start = (model, optim.init(eqx.filter(model, eqx.is_array)))
    # our step may donate its arguments: it gets copies, the reference the originals
    ours = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, start)
    ref = start
    for (x, y), (gx, gy) in zip(distribute(strategy, batches), batches, strict=True):
        *ours, loss = step(*ours, x, y)
        *ref, ref_loss = reference(*ref, gx, gy)
    assert_trees_close(eqx.filter(ours[0], eqx.is_array), eqx.filter(ref[0], eqx.is_array))
    return (*ours, loss), (*ref, ref_loss), strategy, step


def _mlp():
    return eqx.nn.MLP(in_size=4, out_size=2, width_size=16, depth=2, key=jax.random.key(0))


def test_module_as_argument_equals_filter_jit_on_one_device():
    model = _mlp()
    (trained, _, loss), (_, _, ref_loss), _, step = _train(
        model, regression_batches(3, rows=16, inputs=4, outputs=2)
    )
    assert isinstance(trained, eqx.nn.MLP) and trained.activation is model.activation
    np.testing.assert_allclose(float(jnp.mean(loss)), float(ref_loss), rtol=1e-5)
    assert step.cache_size == 1  # the module's static parts hash the same every step


def test_parameter_sharding_holds_the_module_split_and_equals_one_device():
    """`shard_parameters=True` with the module and optimizer state declared as state
    (donated): each array leaf comes back split across the replicas, same numbers."""
    batches = regression_batches(3, rows=16, inputs=4, outputs=2)
    (trained, _, _), _, strategy, _ = _train(
        _mlp(), batches, donate_argnums=(0, 1), shard_parameters=True
    )
    hidden = trained.layers[1].weight  # f32[16,16]
    assert strategy.is_held_sharded(hidden)
    assert {s.data.shape for s in hidden.addressable_shards} == {(2, 16)}


class Attention(eqx.Module):
    """equinox's attention module with the float and int fields its docs give it: a
    dropout probability (0.0) in MultiheadAttention and a sequence length used in a shape."""

    attention: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear
    seq_len: int

    def __init__(self, key, seq_len=4, size=8):
        k1, k2 = jax.random.split(key)
        self.attention = eqx.nn.MultiheadAttention(num_heads=2, query_size=size, key=k1)
        self.head = eqx.nn.Linear(size * seq_len, 2, key=k2)
        self.seq_len = seq_len

    def __call__(self, x):
        h = self.attention(x, x, x)
        return self.head(jnp.reshape(h, (self.seq_len * h.shape[-1],)))


def test_modules_with_float_and_int_fields_are_static_as_under_filter_jit():
    """A Python number inside a module is static (as eqx.filter_jit has it): the dropout
    probability stays a float that `Dropout` can test, and `seq_len` a shape."""
    model = Attention(jax.random.key(0))
    assert model.attention.dropout.p == 0.0 and isinstance(model.seq_len, int)
    rng = np.random.default_rng(1)
    batches = [
        (
            rng.normal(size=(16, 4, 8)).astype(np.float32),
            rng.normal(size=(16, 2)).astype(np.float32),
        )
        for _ in range(3)
    ]
    (trained, _, _), _, _, step = _train(model, batches)
    assert trained.seq_len == 4 and trained.attention.dropout.p == 0.0
    assert step.cache_size == 1


def test_a_static_part_holding_a_list_is_keyed_as_filter_jit_keys_it():
    class Scaled(eqx.Module):
        weight: jax.Array
        sizes: list  # a list field: the module is unhashable

        def __call__(self, x):
            return (x @ self.weight) * len(self.sizes)

    def loss(params, static, x):
        return jnp.sum(eqx.combine(params, static)(x) ** 2)

    strategy = xs.OneDeviceStrategy()
    step = strategy.compile(loss, static_argnums=1)
    x = jnp.arange(12.0).reshape(4, 3)
    for sizes in ([1, 2], [1, 2], [1, 2, 3]):
        params, static = eqx.partition(Scaled(jnp.ones((3, 2)), sizes), eqx.is_array)
        want = eqx.filter_jit(loss)(params, static, x)
        np.testing.assert_allclose(float(step(params, static, x)), float(want), rtol=1e-6)
    assert step.cache_size == 2  # equal lists hit the cache; a longer one compiles again
