"""What a step with stages computes besides its gradient is computed on each replica's
whole batch, as without stages: a sum, a maximum, a standard deviation over the batch, a
metric of the loss's per-example auxiliary output; and a sum, a maximum or a minimum the
loss returns of its rows is the batch's. (Computed on microbatches and averaged, a sum
came back M times smaller and a maximum as the mean of the microbatches' maxima.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_pipeline_stages import TX, _assert_mirrored_and_equal, _plain_batches, _plain_params
from test_pipeline_stages_nnx import _NnxScanned

import xla_strategies as xs


def _loss_and_errors(params, x, y):
    """`_plain_loss`, with each example's error as its auxiliary output."""
    h = jnp.tanh(x * params["embed"])

    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None

    h, _ = jax.lax.scan(layer, h, {"w": params["w"], "b": params["b"]})
    errors = jnp.mean((h @ params["head"] - y) ** 2, axis=1)
    statistics = {"sum": jnp.sum(errors), "max": jnp.max(errors), "min": jnp.min(errors)}
    return errors.mean(), (errors, statistics)


def _metrics(strategy, **options):
    """One adam step's loss, metrics and new parameters, per replica."""

    @strategy.compile(**options)
    def step(params, opt_state, x, y):
        (loss, (errors, statistics)), grads = jax.value_and_grad(_loss_and_errors, has_aux=True)(
            params, x, y
        )
        updates, opt_state = TX.update(grads, opt_state, params)
        metrics = {
            "loss": loss,
            "sum": jnp.sum(y),
            "max": jnp.max(x),
            "std": jnp.std(x),
            "positive": jnp.sum(x > 0),
            "worst": jnp.max(errors),
            "errors": errors,
            **{f"loss's {name}": value for name, value in statistics.items()},
        }
        return jax.tree.map(lambda p, u: p + u, params, updates), opt_state, metrics

    params = _plain_params()
    with strategy.scope():
        state = strategy.replicate(params), strategy.replicate(TX.init(params))
    ((x, y),) = strategy.experimental_distribute_dataset(_plain_batches()[:1])
    new_params, _, metrics = step(*state, x, y)
    return jax.tree.map(np.asarray, metrics), jax.tree.map(np.asarray, new_params)


def _each_replicas(x, y, replicas):
    """What each replica's step returns, computed eagerly on its rows with numpy and the
    loss itself."""
    params = _plain_params()
    for x_rows, y_rows in zip(np.split(x, replicas), np.split(y, replicas), strict=True):
        loss, (errors, statistics) = _loss_and_errors(params, x_rows, y_rows)
        yield {
            "loss": loss,
            "sum": y_rows.sum(),
            "max": x_rows.max(),
            "std": x_rows.std(),
            "positive": (x_rows > 0).sum(),
            "worst": errors.max(),
            "errors": errors,
            **{f"loss's {name}": value for name, value in statistics.items()},
        }


@pytest.mark.parametrize("microbatches", [2, 4])
def test_metrics_over_the_batch_are_the_whole_batchs_as_without_stages(microbatches):
    """4 replicas of 2 stages: each replica's metrics are those of its 8 rows, computed
    eagerly; the parameters are one device's."""
    staged = xs.MirroredStrategy(pipeline_stages=2)
    got, got_params = _metrics(staged, microbatches=microbatches)
    _, want_params = _metrics(xs.OneDeviceStrategy())
    replicas = staged.num_replicas_in_sync
    assert replicas == 4
    for replica, want in enumerate(_each_replicas(*_plain_batches()[0], replicas)):
        for name, value in want.items():
            mine = got[name].reshape(replicas, *np.shape(value))[replica]
            np.testing.assert_allclose(mine, value, rtol=2e-5, atol=1e-6, err_msg=name)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6), got_params, want_params
    )


def test_a_step_that_takes_other_gradients_on_its_whole_batch_is_an_error_naming_it():
    """The step runs twice, on a microbatch and on the whole batch: a gradient only the
    whole batch takes has no pipelined counterpart."""
    strategy = xs.MirroredStrategy(pipeline_stages=2)

    @strategy.compile(microbatches=4)
    def step(params, x, y):
        loss, grads = jax.value_and_grad(_loss_and_errors, has_aux=True)(params, x, y)
        if x.shape[0] > 2:  # a replica's 8 rows, not a microbatch's 2
            grads = jax.grad(lambda p: _loss_and_errors(p, x, y)[0])(params)
        return loss, grads

    with strategy.scope():
        params = strategy.replicate(_plain_params())
    ((x, y),) = strategy.experimental_distribute_dataset(_plain_batches()[:1])
    with pytest.raises(ValueError, match="more gradients on its whole batch than the 1"):
        step(params, x, y)


def test_the_flax_nnx_tutorials_metrics_count_every_example_with_stages():
    """flax's NNX tutorial step, its `nnx.MultiMetric` updated in place beside the
    gradient: with stages, 3 steps of 32 examples count 96, as under `nnx.jit` (they
    counted 24: each microbatch's 8, averaged)."""

    def loss_fn(model, batch):
        logits = model(batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, logits

    def train_step(model, optimizer, metrics, batch):
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    def objects():
        model = _NnxScanned(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
        return model, optimizer, metrics

    rng = np.random.default_rng(0)
    batches = [
        {"image": rng.normal(size=(32, 16)).astype(np.float32), "label": rng.integers(0, 3, 32)}
        for _ in range(3)
    ]
    one_device = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(one_device):
        want = objects()
        for batch in batches:
            nnx.jit(train_step)(*want, batch)
    strategy = xs.MirroredStrategy(pipeline_stages=2)
    with strategy.scope():
        got = objects()
    step = strategy.compile(train_step, microbatches=4)
    for batch in strategy.experimental_distribute_dataset(batches):
        step(*got, batch)
    assert int(np.asarray(got[2].accuracy.count[...])) == 96
    for name, value in want[2].compute().items():
        np.testing.assert_allclose(np.asarray(got[2].compute()[name]), value, rtol=1e-5)
    _assert_mirrored_and_equal(nnx.state(got[0], nnx.Param), nnx.state(want[0], nnx.Param))


_SEEDS = {
    "a loss scale": lambda loss: jnp.asarray(64.0, loss.dtype),  # the same on every replica
    "ones like the loss": lambda loss: 8.0 * jnp.ones_like(loss),  # typed per replica
    "each replica's own": lambda loss: jax.lax.stop_gradient(1.0 / loss),
}


def _sgd_seeded_by(seed_of, strategy, **options):
    """Two SGD steps whose gradient is `jax.vjp`'s pullback seeded by `seed_of(loss)`."""

    @strategy.compile(**options)
    def step(params, x, y):
        loss, pullback = jax.vjp(lambda p: _loss_and_errors(p, x, y)[0], params)
        (grads,) = pullback(seed_of(loss))
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss

    with strategy.scope():
        params = strategy.replicate(_plain_params())
    for x, y in strategy.experimental_distribute_dataset(_plain_batches()[:2]):
        params, _ = step(params, x, y)
    return params


@pytest.mark.parametrize("seed", ["a loss scale", "ones like the loss"])
def test_a_pullbacks_seed_scales_the_gradient_with_stages(seed):
    """A step that seeds `jax.vjp`'s pullback itself gets the seed's multiple of the
    gradient, with stages as on one device (with stages, a `jax.vjp` step was refused as
    taking no gradient, and a seed that is not a Python number failed to trace on every
    strategy: JAX refused its type against the per-replica loss)."""
    got = _sgd_seeded_by(_SEEDS[seed], xs.MirroredStrategy(pipeline_stages=2), microbatches=4)
    want = _sgd_seeded_by(_SEEDS[seed], xs.OneDeviceStrategy())
    unseeded = _sgd_seeded_by(lambda loss: 1.0, xs.OneDeviceStrategy())
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), want, unseeded)
    assert max(jax.tree.leaves(moved)) > 1e-3  # the seed changes the update
    _assert_mirrored_and_equal(got, want)
    _assert_mirrored_and_equal(_sgd_seeded_by(_SEEDS[seed], xs.MirroredStrategy()), want)


def test_a_seed_that_differs_across_replicas_makes_the_gradient_nan_with_stages():
    """The stages sum the replicas' gradients before the seed is known, so a seed computed
    from each replica's own loss cannot scale each one's: the update is NaN, not silently
    another; without stages it is each replica's own."""
    seeded = _SEEDS["each replica's own"]
    got = _sgd_seeded_by(seeded, xs.MirroredStrategy(pipeline_stages=2), microbatches=4)
    assert all(np.isnan(np.asarray(leaf)).all() for leaf in jax.tree.leaves(got))
    plain = _sgd_seeded_by(seeded, xs.MirroredStrategy())
    assert not any(np.isnan(np.asarray(leaf)).any() for leaf in jax.tree.leaves(plain))


def test_an_auxiliary_output_no_rule_combines_is_named_in_a_warning():
    """A standard deviation of the loss's rows has no rule that gives the batch's from
    the microbatches': the step says which output comes back as their mean (it came back
    so silently); the outputs a rule combines are not named."""

    def loss_fn(params, x, y):
        loss, (errors, statistics) = _loss_and_errors(params, x, y)
        return loss, {"spread": jnp.std(errors), "worst": statistics["max"], "each": errors}

    strategy = xs.MirroredStrategy(pipeline_stages=2)

    @strategy.compile(microbatches=4)
    def step(params, x, y):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        return loss, aux, grads

    with strategy.scope():
        params = strategy.replicate(_plain_params())
    ((x, y),) = strategy.experimental_distribute_dataset(_plain_batches()[:1])
    with pytest.warns(UserWarning, match=r"output \['spread'\] comes back as") as caught:
        step(params, x, y)
    named = [str(w.message) for w in caught if "auxiliary output" in str(w.message)]
    assert len(named) == 1 and "worst" not in named[0] and "each" not in named[0]
