"""Random draws in a pipelined loss. The stages run the loss once per microbatch, where
the user wrote it for the whole batch: each microbatch draws its own dropout masks (the
embedding's, the layers', the head's), and a layer's backward recomputes the mask its
forward drew, so the gradient is the drawn loss's. A draw the step makes outside the loss
is the whole batch's, as under `jax.jit`, and the loss reads its microbatch's rows of it."""

import jax
import jax.numpy as jnp
import numpy as np
from test_pipeline_metrics import _loss_and_errors
from test_pipeline_stages import _plain_params

import xla_strategies as xs


def _dropout(x, key, rate=0.5):
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0)


def _loss_with_dropout(params, key, x, y):
    h = _dropout(jnp.tanh(x * params["embed"]), jax.random.fold_in(key, 0))

    def layer(h, w):
        return _dropout(jnp.tanh(h @ w["w"] + w["b"]), jax.random.fold_in(key, 1)), None

    h, _ = jax.lax.scan(layer, h, {"w": params["w"], "b": params["b"]})
    out = _dropout(h, jax.random.fold_in(key, 2)) @ params["head"]
    errors = jnp.mean((out - y) ** 2, axis=1)
    return errors.mean(), errors


def _pipelined_step():
    strategy = xs.MirroredStrategy(pipeline_stages=2)

    @strategy.compile(microbatches=4)
    def step(params, key, x, y):
        (loss, errors), grads = jax.value_and_grad(_loss_with_dropout, has_aux=True)(
            params, key, x, y
        )
        return loss, errors, grads

    return strategy, step


def test_each_microbatch_draws_its_own_masks():
    """The same 2 rows as each replica's 4 microbatches come back with 4 different errors
    (a key the step is given draws alike on every replica, as documented)."""
    strategy, step = _pipelined_step()
    rng = np.random.default_rng(0)
    rows = np.tile(rng.normal(size=(2, 16)), (16, 1)).astype(np.float32)
    ((x, y),) = strategy.experimental_distribute_dataset([(rows, np.sin(rows[:, :3]))])
    with strategy.scope():
        params = strategy.replicate(_plain_params())
    _, errors, _ = step(params, jax.random.key(7), x, y)
    per_replica = np.asarray(errors).reshape(strategy.num_replicas_in_sync, 4, 2)
    for microbatches in per_replica:
        assert len({tuple(np.round(e, 6)) for e in microbatches}) == 4, per_replica


def test_the_gradient_is_the_drawn_losss_by_central_differences():
    """In float64, the gradient along a random direction equals the central difference of
    the pipelined loss itself: a backward that drew other masks than its forward would
    differentiate another loss."""
    with jax.enable_x64(True):
        strategy, step = _pipelined_step()
        params = jax.tree.map(lambda a: np.asarray(a, np.float64), _plain_params())
        rng = np.random.default_rng(1)
        x = rng.normal(size=(32, 16))
        direction = jax.tree.map(lambda a: rng.normal(size=np.shape(a)), params)
        (batch,) = strategy.experimental_distribute_dataset([(x, np.sin(x[:, :3]))])
        key = jax.random.key(3)

        def loss_and_gradient(at):
            with strategy.scope():
                held = strategy.replicate(at)
            loss, _, grads = step(held, key, *batch)
            return float(strategy.reduce("MEAN", loss, axis=None)), grads

        _, grads = loss_and_gradient(params)
        eps = 1e-6
        up, _ = loss_and_gradient(jax.tree.map(lambda p, d: p + eps * d, params, direction))
        down, _ = loss_and_gradient(jax.tree.map(lambda p, d: p - eps * d, params, direction))
        along = sum(
            float(np.vdot(np.asarray(g), d))
            for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction), strict=True)
        )
        np.testing.assert_allclose((up - down) / (2 * eps), along, rtol=1e-6)


def _augmented_step(strategy, **options):
    """A step that augments its batch with noise drawn outside the loss, which the loss
    reads from its closure."""

    @strategy.compile(**options)
    def step(params, key, x, y):
        noisy = x + 0.3 * jax.random.normal(key, x.shape)

        def loss_fn(params):
            return _loss_and_errors(params, noisy, y)

        (loss, errors), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, errors, grads

    return step


def test_an_augmentation_drawn_outside_the_loss_is_the_whole_batchs_draw():
    """Noise the step draws for its whole batch before the loss reads it: each microbatch
    reads its rows of the one draw `jax.jit` makes (each read the same draw of a
    microbatch's shape, the noise of one microbatch repeated M times)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, 16)).astype(np.float32)
    batch = [(x, np.sin(x[:, :3]))]
    runs = {}
    for name, strategy, options in [
        ("stages", xs.MirroredStrategy(jax.devices()[:2], pipeline_stages=2), {"microbatches": 4}),
        ("one device", xs.OneDeviceStrategy(), {}),
    ]:
        step = _augmented_step(strategy, **options)
        with strategy.scope():
            params = strategy.replicate(_plain_params())
        (args,) = strategy.experimental_distribute_dataset(batch)
        runs[name] = jax.tree.map(np.asarray, step(params, jax.random.key(5), *args))
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6),
        runs["stages"],
        runs["one device"],
    )
