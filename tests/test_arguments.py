"""What a step may take and return: static arguments, non-array leaves, typed PRNG keys,
and the user's name for the replica axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import xla_strategies as xs
from xla_strategies.core.layout import Layout
from xla_strategies.hardware.hlo import count_hlo_collectives

R = 8


@pytest.fixture(scope="module")
def mirrored():
    return xs.MirroredStrategy()


def _batch(strategy, rows=16, cols=3, seed=0):
    data = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    return data, next(iter(strategy.experimental_distribute_dataset([data])))


# static arguments


def test_static_argnames_flag_and_cache_key(mirrored):
    def step(w, x, train=False, scale=1.0):
        y = x @ w
        return (jnp.mean(y) if train else jnp.sum(y)) * scale

    compiled = mirrored.compile(step, static_argnames="train")
    data, x = _batch(mirrored)
    w = np.ones((3, 1), np.float32)
    per_replica = data.reshape(R, -1, 3) @ w
    mean = compiled(w, x, train=True, scale=1.0)
    np.testing.assert_allclose(mean, per_replica.mean(axis=(1, 2)), rtol=1e-6)
    total = compiled(w, x, train=False, scale=1.0)
    np.testing.assert_allclose(total, per_replica.sum(axis=(1, 2)), rtol=1e-5)
    doubled = compiled(w, x, train=True, scale=2.0)  # a traced float: no new program
    np.testing.assert_allclose(doubled, 2 * per_replica.mean(axis=(1, 2)), rtol=1e-6)
    assert compiled.cache_size == 2


def test_static_argnums_take_a_whole_argument(mirrored):
    @mirrored.compile(static_argnums=1)
    def step(x, config):
        factor, name = config
        return x * factor + len(name)

    assert float(step(np.float32(2.0), (3, "ab"))) == 8.0


def test_non_array_leaves_are_static(mirrored):
    @mirrored.compile
    def step(x, options):
        activation, mode = options["activation"], options["mode"]
        return activation(x) if mode == "apply" else x, options  # static leaves come back

    x = mirrored.replicate(np.array([-1.0, 2.0], np.float32))
    options = {"activation": jax.nn.relu, "mode": "apply", "unused": None}
    y, same = step(x, options)
    np.testing.assert_array_equal(np.asarray(y), [0.0, 2.0])
    assert same["activation"] is jax.nn.relu and same["mode"] == "apply"
    step(y, {**options, "mode": "skip"})
    assert step.cache_size == 2


def test_unhashable_static_values_name_their_path(mirrored):
    step = mirrored.compile(lambda x, cfg: x * len(cfg["a"]), static_argnums=1)
    assert float(step(np.float32(1.0), {"a": [1, 2]})) == 2.0  # keyed by its hashable leaves
    with pytest.raises(TypeError, match=r"lambda> argument args\[1\] is declared static and"):
        step(np.float32(1.0), {"a": [_Unhashable()]})
    plain = mirrored.compile(lambda x, cfg: x, name="plain")
    with pytest.raises(TypeError, match=r"plain argument args\[1\]\['s'\] is not an array"):
        plain(np.float32(1.0), {"s": _Unhashable()})


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


def test_bad_compile_options(mirrored):
    with pytest.raises(TypeError, match="needs a function, got a int"):
        mirrored.compile(42)

    def step(w, train):
        return w

    with pytest.raises(ValueError, match=r"names \['nope'\], which step does not take"):
        mirrored.compile(step, static_argnames=["nope"])
    with pytest.raises(TypeError, match="static_argnums must be non-negative ints"):
        mirrored.compile(step, static_argnums="train")
    with pytest.raises(TypeError, match="axis_name must be a non-empty string"):
        mirrored.compile(step, axis_name=("a", "b"))


# typed PRNG keys


def test_typed_keys_round_trip_and_fold_in_per_replica(mirrored):
    @mirrored.compile
    def step(key, x):
        replica = xs.get_replica_context().replica_id_in_sync_group
        noise = jax.random.normal(jax.random.fold_in(key, replica), x.shape)
        return key, jax.random.split(key)[1], noise, jax.random.fold_in(key, replica)

    key = jax.random.key(42)
    _, x = _batch(mirrored)
    same, split, noise, per_replica = step(key, x)
    assert jnp.issubdtype(same.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(same), jax.random.key_data(key))
    np.testing.assert_array_equal(
        jax.random.key_data(split), jax.random.key_data(jax.random.split(key)[1])
    )
    assert per_replica.shape == (R,) and mirrored.layout(per_replica) is Layout.STACKED
    expected = [jax.random.normal(jax.random.fold_in(key, r), (2, 3)) for r in range(R)]
    np.testing.assert_allclose(np.asarray(noise), np.stack(expected), rtol=1e-6)
    # a stacked key array goes back in as one key per replica
    echoed = mirrored.compile(lambda k: k)(per_replica)
    np.testing.assert_array_equal(jax.random.key_data(echoed), jax.random.key_data(per_replica))


def test_stacked_keys_give_each_replica_its_own(mirrored):
    keys = jax.random.split(jax.random.key(0), R)
    stacked = jax.device_put(keys, mirrored.stacked_sharding())

    @mirrored.compile
    def step(key):
        return key.shape, jax.random.key_data(key)

    shape, data = step(stacked)
    assert tuple(np.asarray(shape)) == ()  # one key per replica, not a batch of one
    np.testing.assert_array_equal(np.asarray(data), np.asarray(jax.random.key_data(keys)))


# axis names


def _pmap_style_step(w, x, y):
    """Written for `jax.pmap(..., axis_name="batch")`."""
    loss, grads = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    grads = lax.pmean(grads, "batch")
    loss = lax.pmean(loss, "batch")
    count = lax.psum(1, "batch")
    return w - 0.1 * grads, loss, count, lax.axis_index("batch")


@pytest.mark.parametrize(
    "make", [xs.MirroredStrategy, lambda: xs.TPUStrategy("v5e-8", emulate=True)]
)
def test_pmap_code_runs_under_its_axis_name(make):
    strategy = make()
    step = strategy.compile(_pmap_style_step, axis_name="batch")
    rng = np.random.default_rng(1)
    xs_, ys = rng.normal(size=(16, 3)), rng.normal(size=(16, 1))
    xs_, ys = xs_.astype(np.float32), ys.astype(np.float32)
    x, y = next(iter(strategy.experimental_distribute_dataset([(xs_, ys)])))
    w = np.zeros((3, 1), np.float32)
    new_w, loss, count, index = step(w, x, y)
    ref_loss, ref_grad = jax.value_and_grad(lambda w: jnp.mean((xs_ @ w - ys) ** 2))(w)
    np.testing.assert_allclose(np.asarray(new_w), w - 0.1 * ref_grad, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    assert int(count) == R and np.asarray(index).tolist() == list(range(R))
    # the user's pmean of already-reduced gradients costs no second all-reduce
    graph = step.graph(w, x, y, after="fold-invariant-reductions")
    assert graph.count_ops("all_reduce") == 2  # the gradient and the loss
    hlo = step.lower(w, x, y).compile().as_text()
    assert count_hlo_collectives(hlo)["all-reduce"] <= 2


def test_unknown_axis_suggests_axis_name(mirrored):
    step = mirrored.compile(_pmap_style_step)
    _, x = _batch(mirrored)
    with pytest.raises(xs.UnknownAxisError, match=r"compile\(axis_name='batch'\)"):
        step(np.zeros((3, 1), np.float32), x, x[:, :1])


# found in review


def test_python_numbers_are_weakly_typed_and_range_checked(mirrored):
    step = mirrored.compile(lambda x, c: x * c)
    x = mirrored.replicate(jnp.ones(3, jnp.bfloat16))
    assert step(x, 0.5).dtype == jnp.bfloat16  # as under jax.jit
    with pytest.raises(OverflowError):
        step(x, 2**40)


def test_static_containers_of_other_types_are_other_programs(mirrored):
    step = mirrored.compile(lambda x, cfg: x + cfg[0], static_argnums=1)
    assert float(step(np.float32(1), (2, 0))) == 3.0
    assert float(step(np.float32(1), (True, 0))) == 2.0 and step.cache_size == 2


def test_static_arguments_are_static_by_position_or_by_name(mirrored):
    def step(x, n):
        return x * jnp.ones(n)  # n must be a Python int

    by_name = mirrored.compile(step, static_argnames="n")
    assert by_name(np.float32(2), 3).shape == (3,)  # passed positionally
    by_number = mirrored.compile(step, static_argnums=1)
    assert by_number(np.float32(2), n=4).shape == (4,)  # passed by name


def test_a_stacked_array_must_have_one_row_per_replica(mirrored):
    bad = jax.device_put(jnp.arange(16.0), mirrored.stacked_sharding())
    with pytest.raises(ValueError, match=r"shape \(16,\) is stacked .* one row per replica \(8\)"):
        mirrored.compile(lambda s: s.sum())(bad)


def test_one_array_passed_as_two_pieces_of_state_is_donated_once(mirrored):
    @mirrored.compile(donate_argnums=(0, 1))
    def step(params, slow, x):
        return params * 0.9, slow + 0.0, x.sum()

    params = mirrored.replicate(np.ones(3, np.float32))
    new, slow, _ = step(params, params, _batch(mirrored, cols=3)[1])  # lookahead-style
    np.testing.assert_allclose(np.asarray(slow), 1.0)
    np.testing.assert_allclose(np.asarray(new), 0.9)
    assert params.is_deleted()


def test_a_batch_leaf_of_python_objects_is_named_by_its_path(mirrored):
    batch = {"x": np.ones((16, 3), np.float32), "ids": np.array(["a"] * 16, dtype=object)}
    with pytest.raises(TypeError, match=r"dataset element 0\['ids'\] is a numpy array of dtype"):
        list(mirrored.experimental_distribute_dataset([batch]))
    step = mirrored.compile(lambda p, b: p + b["x"].sum())
    with pytest.raises(TypeError, match=r"argument args\[1\]\['ids'\] is a numpy array of dtype"):
        step(mirrored.replicate(np.zeros((), np.float32)), batch)


def test_saving_a_donated_state_names_the_deleted_leaf(mirrored, tmp_path):
    @mirrored.compile(donate_argnums=0)
    def step(params):
        return jax.tree.map(lambda w: w + 1, params)

    params = mirrored.replicate({"w": np.ones(3, np.float32), "b": np.ones(1, np.float32)})
    new = step(params)
    with xs.CheckpointManager(tmp_path, mirrored, async_save=False) as manager:
        with pytest.raises(ValueError, match=r"save\(state\)\['b'\] was deleted: it was donated"):
            manager.save(1, params)
        manager.save(1, new)  # the returned value saves
        assert manager.all_steps() == [1]


def test_a_compiled_step_called_from_a_traced_function_says_what_to_do(mirrored):
    inner = mirrored.compile(lambda w, x: w * x.mean())
    w = mirrored.replicate(np.ones(3, np.float32))
    _, batch = _batch(mirrored, cols=2)
    nested = (
        r"argument args\[0\] is traced: the step was called from inside a traced function "
        r".* cannot be traced into another"
    )
    with pytest.raises(TypeError, match=nested):
        jax.jit(lambda w, x: inner(w, x))(w, batch)
    with pytest.raises(TypeError, match=nested):
        mirrored.compile(lambda w, x: inner(w, x))(w, batch)
    run_inside = mirrored.compile(lambda w, x: mirrored.run(lambda a, b: a * b.mean(), (w, x)))
    with pytest.raises(RuntimeError, match="strategy.run was called inside a compiled step"):
        run_inside(w, batch)
    assert inner(w, batch).shape == (R, 3)  # called outside, it runs: one row per replica


def test_compile_options_are_one_typed_object_and_a_misspelling_names_the_closest(mirrored):
    with pytest.raises(
        TypeError, match=r"unknown option 'donate_argnum'; did you mean 'donate_argnums'"
    ):
        mirrored.compile(lambda w: w * 2, donate_argnum=0)
    with pytest.raises(TypeError, match=r"unknown option 'shard_parameter'; did you mean"):
        mirrored.set_compile_defaults(shard_parameter=True)
    options = xs.CompileOptions(donate_argnums=0, name="doubled")
    step = mirrored.compile(lambda w: w * 2, options=options)
    assert step.name == "doubled" and step.options is options
    w = mirrored.replicate(np.ones(3, np.float32))
    np.testing.assert_allclose(np.asarray(step(w)), 2.0)
    assert w.is_deleted()  # the typed option took effect: the argument was donated
    with pytest.raises(TypeError, match="give options= or keywords, not both"):
        mirrored.compile(lambda w: w, options=options, name="x")


def test_an_array_read_again_with_another_sharding_is_read_anew(mirrored):
    # the second call's array has the first's shape and dtype: only its sharding says that
    # each replica sees all of it, not its 2 rows
    rows = mirrored.compile(lambda x: jnp.asarray(x.shape[0], jnp.float32))
    data, split = _batch(mirrored)
    per_replica = rows(split)
    whole = rows(mirrored.replicate(data))
    assert set(np.asarray(per_replica).ravel().tolist()) == {2.0}
    assert float(whole) == 16.0 and rows.cache_size == 2


def test_a_state_read_again_keeps_its_program_and_a_deleted_leaf_is_named(mirrored):
    step = mirrored.compile(lambda s: jax.tree.map(lambda w: w * 2, s), donate_argnums=0)
    state = mirrored.replicate({"a": np.ones(3, np.float32), "b": np.ones((2, 2), np.float32)})
    for _ in range(3):  # each call reads the last one's outputs
        old, state = state, step(state)
    assert step.cache_size == 1 and float(state["b"][0, 0]) == 8.0
    with pytest.raises(ValueError, match=r"args\[0\]\['a'\] was donated to an earlier call"):
        step(old)
