"""Reference models for the demo, the examples and the tests (flax NNX).

`MLP` is a small classifier. `TransformerLM` is a GPT-style decoder whose blocks are stacked
and run under `nnx.scan` with `nnx.remat`, with the output projection tied to the input
embedding: the shape of program whose reductions the compiler has to get right.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, sizes: tuple[int, ...], *, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        self.layers = nnx.List(
            [
                nnx.Linear(a, b, rngs=rngs, param_dtype=dtype, dtype=dtype)
                for a, b in zip(sizes, sizes[1:], strict=False)
            ]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


@dataclass(frozen=True)
class TransformerConfig:
    vocab: int = 64
    width: int = 32
    heads: int = 2
    layers: int = 2
    seq_len: int = 16
    dtype: Any = jnp.float32


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention computed in the model's dtype throughout (flax's
    `MultiHeadAttention` takes its softmax in float32 even in a float64 model)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        kw = dict(rngs=rngs, param_dtype=cfg.dtype, dtype=cfg.dtype)
        # No q/k/v biases (as in GPT-NeoX and Llama): the key bias has an identically zero
        # gradient (softmax ignores a shift shared by all keys), and Adam would turn the
        # rounding noise in it into full-size steps that no two reduction orders agree on.
        self.qkv = nnx.Linear(cfg.width, 3 * cfg.width, use_bias=False, **kw)
        self.out = nnx.Linear(cfg.width, cfg.width, **kw)
        self.heads = cfg.heads

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * self.heads, -1), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(x.dtype).min), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width))


class Block(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        kw = dict(rngs=rngs, param_dtype=cfg.dtype, dtype=cfg.dtype)
        self.ln1 = nnx.LayerNorm(cfg.width, **kw)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.width, **kw)
        self.fc1 = nnx.Linear(cfg.width, 4 * cfg.width, **kw)
        self.fc2 = nnx.Linear(4 * cfg.width, cfg.width, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class TransformerLM(nnx.Module):
    """Decoder-only LM: embed, `layers` scanned and rematerialised blocks, tied unembedding."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(
            cfg.vocab, cfg.width, rngs=rngs, param_dtype=cfg.dtype, dtype=cfg.dtype
        )
        self.pos = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.width), cfg.dtype)
        )

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.ln = nnx.LayerNorm(cfg.width, rngs=rngs, param_dtype=cfg.dtype, dtype=cfg.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def run_blocks(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return self.embed.attend(self.ln(run_blocks(x, self.blocks)))


def lm_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> Callable[..., Any]:
    """A per-replica train step for `TransformerLM`: returns params, opt_state, per-token loss."""

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        def loss_fn(p: Any) -> tuple[jax.Array, jax.Array]:
            logits = nnx.merge(graphdef, p)(tokens[:, :-1])
            per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
            return per_token.mean(), per_token.mean(axis=-1)

        (_, per_example), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, per_example

    return step


def mlp_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> Callable[..., Any]:
    """A per-replica train step for `MLP` classification: params, opt_state, per-example loss."""

    def step(
        params: Any, opt_state: Any, batch: dict[str, jax.Array]
    ) -> tuple[Any, Any, jax.Array]:
        def loss_fn(p: Any) -> tuple[jax.Array, jax.Array]:
            logits = nnx.merge(graphdef, p)(batch["x"])
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return per_example.mean(), per_example

        (_, per_example), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, per_example

    return step


def mlp_grad_step(graphdef: nnx.GraphDef) -> Callable[..., Any]:
    """A per-replica gradient step for `MLP` classification, as ParameterServerStrategy
    compiles it: `(params, batch) -> (grads, mean loss)`; the PS tasks apply the update."""

    def step(params: Any, batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
        def loss_fn(p: Any) -> jax.Array:
            logits = nnx.merge(graphdef, p)(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return grads, loss

    return step
