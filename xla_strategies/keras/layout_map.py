"""Keras 3's `LayoutMap` on a strategy whose replicas span several devices.

A Keras user lays a model's variables out with `keras.distribution.LayoutMap` (variable
path patterns -> axes of a `DeviceMesh`). Given to a strategy (`layout_map=`), it applies
to the variables of Keras models built inside `strategy.scope()`: there Keras'
`ModelParallel` distribution is active on the strategy's own mesh, so each variable is
created split over the model axis as the map says, and compiled steps keep it so. A
variable's entry may name only the model axis: the replicas are the strategy's, and state
split across them is `compile(shard_parameters=True)`. A layer output's entry
(`"<layer>/output"`) may also name the batch axis in its first dimension, which the
replicas already split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from xla_strategies.core.layout import MODEL_AXIS


@contextlib.contextmanager
def layout_map_scope(keras: Any, strategy: Any) -> Iterator[None]:
    """While active, Keras creates variables as `strategy.layout_map` lays them out."""
    layouts = strategy.layout_map
    if layouts is None:
        yield
        return
    mesh = strategy.mesh
    device_mesh = keras.distribution.DeviceMesh(
        shape=tuple(mesh.devices.shape),
        axis_names=list(mesh.axis_names),
        devices=list(mesh.devices.flat),
    )
    ours = keras.distribution.LayoutMap(device_mesh)
    for pattern, layout in layouts.items():
        ours[pattern] = _model_axes(pattern, layout)
    distribution = keras.distribution.ModelParallel(
        layout_map=ours, batch_dim_name=strategy.replica_axes[0]
    )
    with distribution.scope():
        yield


def _model_axes(pattern: str, layout: Any) -> tuple[str | None, ...]:
    """The layout a replica gives what `pattern` names. A layer output's entry (Keras
    keys them `<layer path>/output`) may name the batch axis in its first dimension, as
    Keras' distribution guide writes it (`("data", None)`): the replicas split the batch
    already, so inside one replica that dimension is whole."""
    axes = tuple(getattr(layout, "axes", layout))
    if pattern.rstrip("$").endswith("output") and axes and axes[0] not in (None, MODEL_AXIS):
        axes = (None, *axes[1:])
    other = [a for a in axes if a not in (None, MODEL_AXIS)]
    if not other:
        return axes
    if pattern.rstrip("$").endswith("output"):
        raise ValueError(
            f"layout_map[{pattern!r}] = {axes} names the axes {other} past an output's "
            f"batch dimension; inside a replica the other dimensions can be split over "
            f"{MODEL_AXIS!r} (the devices of one replica) only"
        )
    raise ValueError(
        f"layout_map[{pattern!r}] = {axes} names the axes {other}; a variable's layout here "
        f"names {MODEL_AXIS!r} (the devices of one replica) or None, since every replica "
        "holds the whole variable. To hold variables split across the replicas too, "
        "compile the step with shard_parameters=True"
    )
