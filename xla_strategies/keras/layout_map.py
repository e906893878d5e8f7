"""Keras 3's `LayoutMap` on a strategy whose replicas span several devices.

A Keras user lays a model's variables out with `keras.distribution.LayoutMap` (variable
path patterns -> axes of a `DeviceMesh`). Given to a strategy (`layout_map=`), it applies
to the variables of Keras models built inside `strategy.scope()`: there Keras'
`ModelParallel` distribution is active on the strategy's own mesh, so each variable is
created split over the model axis as the map says, and compiled steps keep it so. Only
the model axis may be named: the replicas are the strategy's, and state split across
them is `compile(shard_parameters=True)`.
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
    axes = tuple(getattr(layout, "axes", layout))
    other = [a for a in axes if a not in (None, MODEL_AXIS)]
    if other:
        raise ValueError(
            f"layout_map[{pattern!r}] = {axes} names the axes {other}; a layout here names "
            f"{MODEL_AXIS!r} (the devices of one replica) or None. To split variables "
            "across the replicas too, compile the step with shard_parameters=True"
        )
    return axes
