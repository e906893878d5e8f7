"""Transformers written as a plain JAX user writes them, with no library: the parameters a
dict of arrays, the layers' weights stacked on a leading axis and run by `jax.lax.scan`
over a `jax.checkpoint`ed block, bf16 compute on f32 weights, tied input and output
embeddings, adamw. The same architectures as `benchmarks.tpu_models`' flax programs,
spelled another way: a pass that wins on one spelling and loses on the other is found here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.tpu_models import TransformerConfig, Workload, lm_workload

COMPUTE = jnp.bfloat16


def _normal(key: jax.Array) -> Callable[[tuple[int, ...]], jax.Array]:
    """A maker of f32 weights of GPT-2's initial scale, each from its own key."""
    keys = iter(jax.random.split(key, 16))
    return lambda shape: 0.02 * jax.random.normal(next(keys), shape, jnp.float32)


def init_params(cfg: TransformerConfig, key: jax.Array) -> dict[str, Any]:
    """GPT-2's parameters: token and position embeddings (the token table also the output
    layer), and each layer's weights stacked on a leading axis of `cfg.layers`."""
    w, m, n = cfg.width, cfg.mlp, cfg.layers
    normal = _normal(key)
    return {
        "wte": normal((cfg.vocab, w)),
        "wpe": normal((cfg.seq_len, w)),
        "blocks": {
            "ln1": {"scale": jnp.ones((n, w)), "bias": jnp.zeros((n, w))},
            "qkv": {"kernel": normal((n, w, 3 * w)), "bias": jnp.zeros((n, 3 * w))},
            "out": {"kernel": normal((n, w, w)), "bias": jnp.zeros((n, w))},
            "ln2": {"scale": jnp.ones((n, w)), "bias": jnp.zeros((n, w))},
            "fc": {"kernel": normal((n, w, m)), "bias": jnp.zeros((n, m))},
            "proj": {"kernel": normal((n, m, w)), "bias": jnp.zeros((n, w))},
        },
        "ln_f": {"scale": jnp.ones((w,)), "bias": jnp.zeros((w,))},
    }


def layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return x @ p["kernel"].astype(COMPUTE) + p["bias"].astype(COMPUTE)


def block(cfg: TransformerConfig, x: jax.Array, p: dict[str, Any]) -> jax.Array:
    """One pre-norm GPT-2 layer: causal self-attention, then a GELU MLP."""
    batch, length, width = x.shape
    heads, depth = cfg.heads, width // cfg.heads
    q, k, v = jnp.split(dense(layer_norm(x, p["ln1"]).astype(COMPUTE), p["qkv"]), 3, axis=-1)
    q, k, v = (t.reshape(batch, length, heads, depth) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(depth).astype(COMPUTE)
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(COMPUTE), v)
    x = x + dense(attended.reshape(batch, length, width), p["out"]).astype(x.dtype)
    hidden = jax.nn.gelu(dense(layer_norm(x, p["ln2"]).astype(COMPUTE), p["fc"]))
    return x + dense(hidden, p["proj"]).astype(x.dtype)


def forward(cfg: TransformerConfig, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Logits (f32) of `tokens`: the layers one `lax.scan` over a checkpointed block."""
    x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]

    @jax.checkpoint
    def layer(x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        return block(cfg, x, p), None

    x, _ = jax.lax.scan(layer, x, params["blocks"])
    x = layer_norm(x, params["ln_f"]).astype(COMPUTE)
    return (x @ params["wte"].astype(COMPUTE).T).astype(jnp.float32)


def gpt2_workload(name: str, cfg: TransformerConfig, cast_first: bool = False) -> Workload:
    """GPT-2's train step; `cast_first`: the loss casts every parameter to bf16 before the
    model (mixed precision as many JAX users spell it), instead of each layer casting the
    weight it uses."""

    def logits(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        if cast_first:
            params = jax.tree.map(lambda leaf: leaf.astype(COMPUTE), params)
        return forward(cfg, params, tokens)

    return lm_workload(name, cfg, lambda: init_params(cfg, jax.random.key(0)), logits)


def init_llama(cfg: TransformerConfig, key: jax.Array) -> dict[str, Any]:
    """Llama's parameters: an f32 embedding table, each layer's weights stacked on a leading
    axis of `cfg.layers`, and an untied output layer."""
    w, m, n = cfg.width, cfg.mlp, cfg.layers
    normal = _normal(key)
    return {
        "embed": normal((cfg.vocab, w)),
        "blocks": {
            "attention_norm": jnp.ones((n, w)),
            **{name: normal((n, w, w)) for name in ("wq", "wk", "wv", "wo")},
            "mlp_norm": jnp.ones((n, w)),
            "gate": normal((n, w, m)),
            "up": normal((n, w, m)),
            "down": normal((n, m, w)),
        },
        "norm": jnp.ones((w,)),
        "head": normal((w, cfg.vocab)),
    }


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + 1e-6) * scale


def rotary(x: jax.Array) -> jax.Array:
    """Rotary position embeddings of `x` [batch, length, heads, depth]."""
    half = x.shape[-1] // 2
    angle = jnp.arange(x.shape[1])[:, None] / 10000 ** (jnp.arange(half) / half)
    sin, cos = (f(angle)[None, :, None, :].astype(x.dtype) for f in (jnp.sin, jnp.cos))
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def llama_block(cfg: TransformerConfig, x: jax.Array, p: dict[str, Any]) -> jax.Array:
    """One Llama layer: RMSNorm, causal self-attention with rotary embeddings, a SwiGLU MLP."""
    batch, length, width = x.shape
    heads, depth = cfg.heads, width // cfg.heads
    h = rms_norm(x, p["attention_norm"]).astype(COMPUTE)
    q, k, v = (
        (h @ p[name].astype(COMPUTE)).reshape(batch, length, heads, depth)
        for name in ("wq", "wk", "wv")
    )
    scores = jnp.einsum("bqhd,bkhd->bhqk", rotary(q), rotary(k)) / jnp.sqrt(depth).astype(COMPUTE)
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(COMPUTE), v)
    x = x + (attended.reshape(batch, length, width) @ p["wo"].astype(COMPUTE)).astype(x.dtype)
    h = rms_norm(x, p["mlp_norm"]).astype(COMPUTE)
    gated = jax.nn.silu(h @ p["gate"].astype(COMPUTE)) * (h @ p["up"].astype(COMPUTE))
    return x + (gated @ p["down"].astype(COMPUTE)).astype(x.dtype)


def llama_workload(name: str, cfg: TransformerConfig) -> Workload:
    """Llama's train step: the embedding gathered from its f32 table, the layers one
    `lax.scan` over a checkpointed block, f32 logits of an untied output layer."""

    def logits(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        x = params["embed"][tokens]

        @jax.checkpoint
        def layer(x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
            return llama_block(cfg, x, p), None

        x, _ = jax.lax.scan(layer, x, params["blocks"])
        x = rms_norm(x, params["norm"]).astype(COMPUTE)
        return (x @ params["head"].astype(COMPUTE)).astype(jnp.float32)

    return lm_workload(name, cfg, lambda: init_llama(cfg, jax.random.key(0)), logits)
