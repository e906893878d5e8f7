"""Train a Keras 3 classifier with MirroredStrategy, as tf.distribute's Keras guide does:
build and compile in `strategy.scope()`, then `fit`, `evaluate` and `predict` as usual.

python examples/keras_fit.py --epochs 5
xla-strategies dump --stop-after-compile -- python examples/keras_fit.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported

import keras  # noqa: E402
import numpy as np  # noqa: E402

import xla_strategies as xs  # noqa: E402

CENTRES = np.random.default_rng(0).normal(size=(5, 12)) * 2


def dataset(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Points in 12 dimensions labelled by which of 5 fixed centres is nearest."""
    rng = np.random.default_rng(seed + 1)
    centres = CENTRES
    x = (rng.normal(size=(rows, 12)) * 2).astype("float32")
    labels = np.argmin(((x[:, None] - centres) ** 2).sum(-1), axis=1)
    return x, labels.astype("int32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    xs.emulate_cpu_devices(8)

    strategy = xs.MirroredStrategy()
    print(f"{strategy}: a Keras MLP with BatchNormalization, global batch {args.batch_size}")
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((12,)),
                keras.layers.Dense(64, use_bias=False),
                keras.layers.BatchNormalization(),
                keras.layers.Activation("relu"),
                keras.layers.Dropout(0.1),
                keras.layers.Dense(5),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x, y = dataset(4096)
    x_test, y_test = dataset(1000, seed=1)  # 1000 rows: the last batch does not divide by 8
    model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_split=0.1,
        callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss", patience=2)],
    )
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    predicted = model.predict(x_test, batch_size=args.batch_size, verbose=0).argmax(-1)
    print(f"test loss {loss:.3f}, accuracy {accuracy:.3f}; {len(predicted)} predictions")
    assert len(predicted) == len(x_test)


if __name__ == "__main__":
    main()
