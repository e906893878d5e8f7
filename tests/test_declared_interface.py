"""A step's interface is declared, never guessed: it donates exactly what
`donate_argnums`/`donate_argnames` name, a state type (flax's `TrainState`) is state
without being donated, and a gradient means the same however `jax.vjp` was imported."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import grad as grad_bound_at_import
from jax import vjp as vjp_bound_at_import

import xla_strategies as xs
from xla_strategies.passes.ir.text import print_graph

R = 8


@pytest.fixture(scope="module")
def mirrored():
    return xs.MirroredStrategy()


def _data(rows=16, cols=4, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)


def _loss(w, x):
    return jnp.mean((x @ w - 1.0) ** 2)


def _reference_grad(w, x):
    """The one-device gradient of the mean loss over the global batch, in numpy."""
    return 2 * x.T @ (x @ w - 1.0) / len(x)


def test_a_gradient_step_keeps_the_callers_parameters(mirrored):
    """`grad_step(params, batch) -> (grads, loss)`: grads have the parameters' structure,
    but nothing was declared donated, so the parameters survive the call."""

    @mirrored.compile
    def grad_step(params, batch):
        loss, grads = jax.value_and_grad(lambda p: _loss(p["w"], batch))(params)
        return grads, loss

    params = mirrored.replicate({"w": np.ones((4, 1), np.float32)})
    data = _data()
    grads, _ = grad_step(params, next(iter(mirrored.experimental_distribute_dataset([data]))))
    assert not params["w"].is_deleted()
    np.testing.assert_allclose(
        np.asarray(grads["w"]), _reference_grad(np.ones((4, 1)), data), rtol=1e-5
    )


def test_one_device_never_deletes_an_array_it_was_not_asked_to_donate():
    """A plain `jnp.ones` already on the one device is exactly where the program reads it:
    undeclared it survives, declared it is donated, as under jax.jit."""
    one = xs.OneDeviceStrategy()

    def sgd(w, x):
        return w - 0.1 * jax.grad(_loss)(w, x), _loss(w, x)

    x = _data()
    w = jnp.ones((4, 1))
    new_w, _ = one.compile(sgd)(w, x)
    assert not w.is_deleted()
    np.testing.assert_allclose(
        np.asarray(new_w), 1 - 0.1 * _reference_grad(np.ones((4, 1)), x), rtol=1e-5
    )
    one.compile(sgd, donate_argnums=0)(w, x)
    assert w.is_deleted()


def test_state_is_found_wherever_the_step_returns_it(mirrored):
    """The same Adam step returning (loss, params, opt) instead of (params, opt, loss):
    with the state declared, both are donated and Adam's moments stay held split;
    undeclared, sharding it is an error that says what to declare."""
    tx = optax.adam(1e-2)
    init = {"w": np.ones((16, 8), np.float32)}

    def loss_first(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    step = mirrored.compile(loss_first, donate_argnums=(0, 1), shard_weight_updates=True)
    params, opt_state = mirrored.replicate(init), mirrored.replicate(tx.init(init))
    x = next(iter(mirrored.experimental_distribute_dataset([_data(16, 16)])))
    _, new_params, new_opt = step(params, opt_state, x)
    assert params["w"].is_deleted()  # the moments were copied to their split layout
    assert mirrored.is_held_sharded(new_opt[0].mu["w"])
    assert mirrored.is_held_sharded(new_opt[0].nu["w"])
    assert step.graph(new_params, new_opt, x).io.state_pairs() == {1: 0, 2: 1, 3: 2, 4: 3}
    step(new_params, new_opt, x)
    assert new_params["w"].is_deleted() and new_opt[0].mu["w"].is_deleted()

    # undeclared and returned elsewhere than its own position: not state, so the option
    # would do nothing, and says what to declare instead
    undeclared = mirrored.compile(loss_first, shard_weight_updates=True)
    params, opt_state = mirrored.replicate(init), mirrored.replicate(tx.init(init))
    with pytest.raises(ValueError, match=r"hands back no state: .* donate_argnums"):
        undeclared(params, opt_state, x)
    assert not params["w"].is_deleted()


def test_a_donated_argument_nothing_returns_warns_and_is_kept(mirrored):
    step = mirrored.compile(lambda w, x: jnp.mean(x @ w), donate_argnums=0)
    w = mirrored.replicate(np.ones((4, 1), np.float32))
    with pytest.warns(UserWarning, match=r"donated args\[0\], but no output has its structure"):
        step(w, next(iter(mirrored.experimental_distribute_dataset([_data()]))))
    assert not w.is_deleted()


def test_bad_declarations_name_the_argument(mirrored):
    def step(w, x):
        return w, x

    with pytest.raises(ValueError, match=r"donate_argnames names \['params'\]"):
        mirrored.compile(step, donate_argnames="params")
    with pytest.raises(TypeError, match=r"donate_argnums must be non-negative ints"):
        mirrored.compile(step, donate_argnums="w")
    with pytest.raises(ValueError, match=r"both static and donated"):
        mirrored.compile(step, donate_argnums=0, static_argnames="w")


def test_flax_train_state_is_state_but_is_not_donated_unless_declared(mirrored):
    from flax.training import train_state

    tx = optax.sgd(0.1, momentum=0.9)
    params = {"w": np.ones((8, 4), np.float32)}

    def train_step(state, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    x = next(iter(mirrored.experimental_distribute_dataset([_data(16, 8)])))
    for options, deleted in (({}, False), ({"donate_argnums": 0}, True)):
        state = mirrored.replicate(
            train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        )
        step = mirrored.compile(train_step, shard_weight_updates=True, **options)
        new = step(state, x)
        assert state.params["w"].is_deleted() is deleted
        assert mirrored.is_held_sharded(new.opt_state[0].trace["w"])  # state either way
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second call: nothing to warn about
            step(new, x)


def _pull_ones(out, pullback):
    return pullback(jnp.ones_like(out))[0]


@pytest.mark.parametrize(
    "take_gradient",
    [
        lambda f, w: _pull_ones(*vjp_bound_at_import(f, w)),
        lambda f, w: _pull_ones(*jax.vjp(f, w)),
        lambda f, w: grad_bound_at_import(f)(w),
        lambda f, w: jax.value_and_grad(f)(w)[1],
    ],
    ids=["from-jax-import-vjp", "jax.vjp", "from-jax-import-grad", "jax.value_and_grad"],
)
def test_a_gradient_means_the_same_however_it_was_imported(mirrored, take_gradient):
    """`from jax import vjp`, bound before any step is traced, gives the one-device
    gradient of the mean loss, not the sum over the replicas (R times larger)."""
    data = _data()

    def step(w, x):
        return take_gradient(lambda w: _loss(w, x), w)

    w = np.ones((4, 1), np.float32)
    batch = next(iter(mirrored.experimental_distribute_dataset([data])))
    got = mirrored.compile(step)(mirrored.replicate(w), batch)
    one = xs.OneDeviceStrategy().compile(step)(w, data)
    np.testing.assert_allclose(np.asarray(got), _reference_grad(w, data), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(one), rtol=1e-5)


def test_the_graph_after_a_disabled_pass_is_an_error(mirrored):
    def sgd(w, x):
        grads = jax.grad(lambda w: _loss(w["a"], x) + jnp.mean(x @ w["b"]) ** 2)(w)
        return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads)

    step = mirrored.compile(sgd, shard_weight_updates=False)
    w = mirrored.replicate({"a": np.ones((4, 1), np.float32), "b": np.ones((4, 1), np.float32)})
    x = next(iter(mirrored.experimental_distribute_dataset([_data()])))
    with pytest.raises(ValueError, match="'shard-weight-updates' is disabled in this pipeline"):
        step.graph(w, x, after="shard-weight-updates")
    before = print_graph(step.graph(w, x, after="reassociate-all-reduces"))
    last = print_graph(step.graph(w, x, after="combine-all-reduces"))
    assert last.count("all_reduce(") == 1 and before.count("all_reduce(") == 2
    with pytest.raises(ValueError, match="no pass named 'hoist-all-reduces'"):
        step.graph(w, x, after="hoist-all-reduces")
