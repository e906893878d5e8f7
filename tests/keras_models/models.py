"""Keras models and data the Keras tests share, written as keras.io writes them."""

from __future__ import annotations

import keras
import numpy as np

R = 8


def regression_data(rows=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype("float32")
    return x, (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(rows, 1))).astype("float32")


def sequential():
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )


def functional():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    skip = keras.layers.Dense(16)(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Add()([hidden, skip]))
    return keras.Model(inputs, outputs)


def batch_normalized(momentum=0.99):
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.BatchNormalization(momentum=momentum),
            keras.layers.Dense(1),
        ]
    )


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def compiled_model(make, **compile_args):
    keras.utils.set_random_seed(1)
    model = make()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"], **compile_args
    )
    return model


# keras.io's "Simple MNIST convnet" and "Text classification with Transformer", small


def mnist_convnet():
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


class TransformerBlock(keras.layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.dropout1(self.att(inputs, inputs))
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1))
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = keras.ops.arange(start=0, stop=keras.ops.shape(x)[-1], step=1)
        return self.token_emb(x) + self.pos_emb(positions)


def text_transformer(maxlen=16, vocab_size=50, embed_dim=8):
    inputs = keras.layers.Input(shape=(maxlen,))
    x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads=2, ff_dim=16)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dropout(0.1)(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    x = keras.layers.Dropout(0.1)(x)
    outputs = keras.layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)
