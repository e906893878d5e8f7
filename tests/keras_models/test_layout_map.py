"""Keras 3's own `LayoutMap`, given to a strategy whose replicas span 2 devices: a model
built in its scope is laid out over the model axis as the map says, `fit` trains it as
Keras' `fit` on one device does, and its variables stay split."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import xla_strategies as xs


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu", name="up"),
            keras.layers.Dense(4, name="down"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 8)).astype("float32"), rng.normal(size=(64, 4)).astype("float32")


def _layout_map():
    device_mesh = keras.distribution.DeviceMesh(
        (2,), ["model"], keras.distribution.list_devices()[:2]
    )
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*up/kernel"] = (None, "model")  # Megatron: columns, then rows
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    return layout_map


def test_a_layout_map_splits_the_variables_and_fit_trains_as_on_one_device():
    x, y = _data()
    single = _model()
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    strategy = xs.MirroredStrategy(logical_devices_per_replica=2, layout_map=_layout_map())
    with strategy.scope():
        model = _model()
    kernel = model.get_layer("up").kernel.value
    assert kernel.sharding.spec == P(None, "model") and kernel.sharding.mesh == strategy.mesh
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), single.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    kernel = model.get_layer("up").kernel.value
    assert kernel.addressable_shards[0].data.shape == (8, 16)  # still split after fit


def test_a_layout_map_naming_other_axes_is_an_error():
    device_mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*kernel"] = ("batch", "model")
    strategy = xs.MirroredStrategy(logical_devices_per_replica=2, layout_map=layout_map)
    with pytest.raises(ValueError, match=r"names the axes \['batch'\].*shard_parameters=True"):
        with strategy.scope():
            _model()
    with pytest.raises(ValueError, match="give logical_devices_per_replica > 1"):
        xs.MirroredStrategy(layout_map=layout_map)


def test_an_output_entry_naming_the_batch_axis_is_what_the_replicas_do():
    """Keras' distribution guide lays a layer's output out with the batch axis first
    (`layout_map["d2/output"] = ("data", None)`): the replicas split the batch already, so
    the entry is accepted and `fit` trains as on one device. Past the batch dimension an
    output may name the model axis only."""
    x, y = _data()
    single = _model()
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    device_mesh = keras.distribution.DeviceMesh((4, 2), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for pattern, layout in _layout_map().items():
        layout_map[pattern] = layout.axes
    layout_map["up/output"] = ("data", "model")
    layout_map["down/output"] = ("data", None)
    strategy = xs.MirroredStrategy(logical_devices_per_replica=2, layout_map=layout_map)
    with strategy.scope():
        model = _model()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), single.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)

    wrong = keras.distribution.LayoutMap(device_mesh)
    wrong["up/output"] = (None, "data")
    strategy = xs.MirroredStrategy(logical_devices_per_replica=2, layout_map=wrong)
    with pytest.raises(ValueError, match=r"past an output's batch dimension"):
        with strategy.scope():
            _model()


def test_a_scope_that_fails_to_open_leaves_no_mesh_behind():
    import jax

    device_mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*kernel"] = ("batch", "model")
    strategy = xs.MirroredStrategy(logical_devices_per_replica=2, layout_map=layout_map)
    with pytest.raises(ValueError), strategy.scope():
        pass
    assert jax.sharding.get_abstract_mesh().empty  # the next program traces on no mesh
