"""The models the ahead-of-time TPU benchmark compiles, written as flax linen users write
them: transformer layers under `nn.scan` with `nn.remat`, bf16 compute on f32 parameters,
and ResNet-50 as flax's own ImageNet example builds it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

COMPUTE = jnp.bfloat16


@dataclass(frozen=True)
class TransformerConfig:
    vocab: int
    width: int
    heads: int
    layers: int
    mlp: int
    seq_len: int
    causal: bool = True
    swiglu: bool = False  # Llama: SwiGLU MLP, RMSNorm, no biases, untied output
    batch_per_chip: int = 1
    kv_heads: int | None = None  # Llama-2-70B's grouped-query attention: fewer K/V heads
    #: Megatron's tensor parallelism as flax users annotate it (`nn.with_partitioning` over
    #: "model"): attention split by heads, the MLP by its hidden units, the embedding and
    #: the output layer by the vocabulary
    tensor_parallel: bool = False
    #: attention by JAX's splash attention kernel (Pallas), as MaxText runs it by default,
    #: passed to flax's attention as its `attention_fn`
    splash: bool = False
    #: what `nn.remat` keeps of each layer for the backward pass, by its name in
    #: `jax.checkpoint_policies`; None keeps the layer's input alone (everything else is
    #: computed again). "dots_with_no_batch_dims_saveable" keeps every weight's matmul
    #: output, as MaxText's `remat_policy=minimal` does
    remat_policy: str | None = None
    #: each head's width where it is not width / heads (Gemma's 256); for the flop count
    head_dim: int | None = None

    @property
    def train_flops_per_sequence(self) -> float:
        """The model's flops to train on one sequence, as MaxText counts them
        (`calculate_tflops_training_per_device`): the matmuls of every weight, the output
        layer's and attention's two (half of them under a causal mask), 2 flops per
        multiply-add, and the backward pass twice the forward. No recomputation (remat)
        and no elementwise work: the flops of the model, not of one program of it."""
        s, w = self.seq_len, self.width
        head = self.head_dim or w // self.heads
        q, kv = self.heads * head, (self.kv_heads or self.heads) * head
        mlp = (3 if self.swiglu else 2) * w * self.mlp  # SwiGLU: two matrices in, one out
        per_layer = w * (q + 2 * kv) + q * w + mlp  # queries, keys, values; out; MLP
        weights = 2 * s * (self.layers * per_layer + w * self.vocab)
        attention = 4 * s * s * q * self.layers * (0.5 if self.causal else 1.0)
        return 3.0 * (weights + attention)


#: MaxText's default splash block sizes (`sa_block_*` in its base.yml)
SPLASH_BLOCK = 512


def splash_attention(query: jax.Array, key: jax.Array, value: jax.Array, **_: Any) -> jax.Array:
    """flax's `attention_fn` by JAX's splash attention kernel: causal, each sequence's heads
    at once, queries scaled as `nn.dot_product_attention` scales them."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel,
        splash_attention_mask,
    )

    _, length, heads, depth = query.shape
    causal = splash_attention_mask.CausalMask((length, length))
    block = min(SPLASH_BLOCK, length)
    blocks = splash_attention_kernel.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    kernel = splash_attention_kernel.make_splash_mha(
        splash_attention_mask.MultiHeadMask([causal] * heads),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=blocks,
    )
    query = query / jnp.sqrt(depth).astype(query.dtype)
    heads_first = [jnp.swapaxes(t, 1, 2) for t in (query, key, value)]  # (batch, heads, ...)
    return jnp.swapaxes(jax.vmap(kernel)(*heads_first), 1, 2)


def _split(cfg: TransformerConfig, x: jax.Array, *names: str | None) -> jax.Array:
    """`x` laid out over "model" as Megatron splits that activation (heads, hidden units),
    under tensor parallelism and a mesh (as flax's own boxes, no constraint at `init`
    outside one); as it is otherwise."""
    if not cfg.tensor_parallel or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*names))


def _init(cfg: TransformerConfig, *names: str | None) -> Any:
    """The default Dense initializer, annotated with `names` under tensor parallelism."""
    init = nn.initializers.lecun_normal()
    return nn.with_partitioning(init, names) if cfg.tensor_parallel else init


class GroupedQueryAttention(nn.Module):
    """Llama's causal attention, written out: `kv_heads` key/value heads shared by the
    query heads (Llama-2-70B's grouped-query attention; all heads where None), and under
    tensor parallelism every head's activations on the chip that holds its weights."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        head = cfg.width // cfg.heads
        heads = partial(nn.DenseGeneral, axis=-1, dtype=COMPUTE, use_bias=False)
        split = _init(cfg, None, "model")  # DenseGeneral initialises the flat (in, heads x dim)
        kv_heads = cfg.kv_heads or cfg.heads
        by_head = (None, None, "model", None)  # (batch, sequence, heads, head dim)
        q = _split(cfg, heads((cfg.heads, head), kernel_init=split, name="query")(x), *by_head)
        k = _split(cfg, heads((kv_heads, head), kernel_init=split, name="key")(x), *by_head)
        v = _split(cfg, heads((kv_heads, head), kernel_init=split, name="value")(x), *by_head)
        groups = cfg.heads // kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        out = _split(cfg, nn.dot_product_attention(q, k, v, mask=mask, dtype=COMPUTE), *by_head)
        return nn.DenseGeneral(
            cfg.width,
            axis=(-2, -1),
            dtype=COMPUTE,
            use_bias=False,
            kernel_init=_init(cfg, "model", None),  # flat: (heads x dim, width)
            name="out",
        )(out)


class Block(nn.Module):
    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        cfg = self.cfg
        norm = partial(nn.RMSNorm if cfg.swiglu else nn.LayerNorm, dtype=COMPUTE)
        dense = partial(nn.Dense, dtype=COMPUTE, use_bias=not cfg.swiglu)
        up, down = _init(cfg, None, "model"), _init(cfg, "model", None)
        causal = cfg.causal and not cfg.splash  # the kernel masks by itself
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2])) if causal else None
        h = norm()(x)
        if cfg.kv_heads or cfg.tensor_parallel:
            x = x + GroupedQueryAttention(cfg)(h)
        else:
            x = x + nn.MultiHeadDotProductAttention(
                cfg.heads,
                dtype=COMPUTE,
                use_bias=not cfg.swiglu,
                deterministic=True,
                kernel_init=_init(cfg, None, "model"),  # DenseGeneral's flat kernels
                out_kernel_init=_init(cfg, "model", None),
                **({"attention_fn": splash_attention} if cfg.splash else {}),
            )(h, h, mask=mask)
        h = norm()(x)
        if cfg.swiglu:
            h = nn.silu(dense(cfg.mlp, kernel_init=up)(h)) * dense(cfg.mlp, kernel_init=up)(h)
        else:
            h = nn.gelu(dense(cfg.mlp, kernel_init=up)(h))
        h = _split(cfg, h, None, None, "model")  # (batch, sequence, hidden units)
        x = x + dense(cfg.width, kernel_init=down)(h)
        # the residual stream between layers (what remat keeps of each) split on its
        # features, as MaxText's rules lay out `activation_embed` under tensor parallelism
        return _split(cfg, x, None, None, "model"), None


class Transformer(nn.Module):
    cfg: TransformerConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        vocab_split = nn.with_partitioning(nn.linear.default_embed_init, ("model", None))
        embed = nn.Embed(
            cfg.vocab,
            cfg.width,
            dtype=COMPUTE,
            **({"embedding_init": vocab_split} if cfg.tensor_parallel else {}),
        )
        x = embed(tokens)
        if not cfg.swiglu:
            x = x + nn.Embed(cfg.seq_len, cfg.width, dtype=COMPUTE)(jnp.arange(tokens.shape[1]))
        policy = cfg.remat_policy and getattr(jax.checkpoint_policies, cfg.remat_policy)
        layers = nn.scan(
            nn.remat(Block, policy=policy),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=cfg.layers,
            metadata_params={nn.PARTITION_NAME: None},  # the layer axis is not split
        )
        x, _ = layers(cfg, name="layers")(x, None)
        x = (nn.RMSNorm if cfg.swiglu else nn.LayerNorm)(dtype=COMPUTE)(x)
        if cfg.swiglu:
            return nn.Dense(
                cfg.vocab, dtype=COMPUTE, use_bias=False, kernel_init=_init(cfg, None, "model")
            )(x)
        return embed.attend(x)  # GPT-2 and BERT tie the output to the embedding


def _bottlenecks() -> Iterator[tuple[int, int]]:
    """ResNet-50's bottleneck blocks in order, as (filters, stride): flax's ImageNet
    example's four stages of 3, 4, 6 and 3 blocks, each stage after the first starting
    with stride 2."""
    for stage, blocks in enumerate((3, 4, 6, 3)):
        for block in range(blocks):
            yield 64 * 2**stage, 2 if stage > 0 and block == 0 else 1


class Bottleneck(nn.Module):
    """flax's ImageNet example's BottleneckResNetBlock."""

    filters: int
    strides: tuple[int, int] = (1, 1)
    axis_name: str | None = None  # statistics over the global batch, as flax's example

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        conv = partial(nn.Conv, use_bias=False, dtype=COMPUTE)
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            dtype=COMPUTE,
            axis_name=self.axis_name,
        )
        residual = x
        y = nn.relu(norm()(conv(self.filters, (1, 1))(x)))
        y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(y)))
        y = norm(scale_init=nn.initializers.zeros)(conv(self.filters * 4, (1, 1))(y))
        if residual.shape != y.shape:
            residual = norm()(conv(self.filters * 4, (1, 1), self.strides)(residual))
        return nn.relu(residual + y)


class ResNet50(nn.Module):
    classes: int = 1000
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(64, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False, dtype=COMPUTE)(x)
        norm = nn.BatchNorm(use_running_average=not train, dtype=COMPUTE, axis_name=self.axis_name)
        x = nn.relu(norm(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for filters, stride in _bottlenecks():
            x = Bottleneck(filters, (stride, stride), self.axis_name)(x, train)
        return nn.Dense(self.classes, dtype=COMPUTE)(jnp.mean(x, axis=(1, 2)))


def resnet50_train_flops_per_image(size: int = 224, classes: int = 1000) -> float:
    """ResNet-50's (`ResNet50` above) flops to train on one `size` x `size` image: the
    multiply-adds of its convolutions (a window's taps on padding do none) and of its
    classifier, 2 flops each, and the backward pass twice the forward."""

    def conv(side: int, into: int, out: int, window: int, stride: int = 1) -> tuple[int, int]:
        """The flops and output side of a square convolution padded as flax pads "SAME"."""
        out_side = -(-side // stride)
        low = max((out_side - 1) * stride + window - side, 0) // 2
        taps = sum(0 <= o * stride - low + t < side for o in range(out_side) for t in range(window))
        return 2 * taps * taps * into * out, out_side

    flops, side = conv(size, 3, 64, 7, 2)  # the stem: 3 a side reads the taps SAME reads
    side, into = -(-side // 2), 64  # max pooling, stride 2
    for filters, stride in _bottlenecks():
        reduce, _ = conv(side, into, filters, 1)
        spatial, out = conv(side, filters, filters, 3, stride)
        expand, _ = conv(out, filters, 4 * filters, 1)
        flops += reduce + spatial + expand
        if into != 4 * filters or stride > 1:  # the residual's projection
            flops += conv(side, into, 4 * filters, 1, stride)[0]
        side, into = out, 4 * filters
    return 3.0 * (flops + 2 * into * classes)


def trained_params(variables: Any) -> Any:
    """What the optimizer updates: a model's variables, or its `params` where it also has
    BatchNorm's statistics (ResNet-50)."""
    return variables["params"] if "batch_stats" in variables else variables


@dataclass(frozen=True)
class Workload:
    """A model's abstract initial state, one chip's batch, and its train step."""

    name: str
    init: Callable[[], Any]  # () -> (params, extra state)
    batch: Callable[[int], dict[str, jax.ShapeDtypeStruct]]  # global batch size -> specs
    batch_per_chip: int
    # (tx, axis name of the replicas or None under plain jit) -> step(params, opt, batch)
    step: Callable[[Any, str | None], Callable[..., Any]]
    #: the model's flops to train on one item (a sequence, an image): MFU's numerator
    train_flops_per_item: float


def lm_workload(
    name: str,
    cfg: TransformerConfig,
    init: Callable[[], Any],
    logits: Callable[[Any, jax.Array], jax.Array],
) -> Workload:
    """A language model's workload, whoever wrote the model: `init()` makes its
    parameters, `logits(params, tokens)` its logits of `tokens`; the step takes the next
    token's cross entropy (in f32) and an optax update, a batch being `cfg.seq_len + 1`
    token ids a sequence."""

    def batch(size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"tokens": jax.ShapeDtypeStruct((size, cfg.seq_len + 1), jnp.int32)}

    def step(tx: optax.GradientTransformation, axis_name: str | None) -> Callable[..., Any]:
        def train_step(params, opt_state, batch):
            tokens = batch["tokens"]

            def loss_fn(p):
                out = logits(p, tokens[:, :-1]).astype(jnp.float32)
                return optax.softmax_cross_entropy_with_integer_labels(out, tokens[:, 1:]).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return train_step

    return Workload(name, init, batch, cfg.batch_per_chip, step, cfg.train_flops_per_sequence)


def language_model(name: str, cfg: TransformerConfig) -> Workload:
    model = Transformer(cfg)

    def init() -> Any:
        return model.init(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]

    return lm_workload(name, cfg, init, lambda p, tokens: model.apply({"params": p}, tokens))


def _resnet50() -> Workload:
    def init() -> Any:
        return ResNet50().init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False)

    def batch(size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "image": jax.ShapeDtypeStruct((size, 224, 224, 3), COMPUTE),
            "label": jax.ShapeDtypeStruct((size,), jnp.int32),
        }

    def step(tx: optax.GradientTransformation, axis_name: str | None) -> Callable[..., Any]:
        model = ResNet50(axis_name=axis_name)

        def train_step(variables, opt_state, batch):
            def loss_fn(params):
                logits, updates = model.apply(
                    {"params": params, "batch_stats": variables["batch_stats"]},
                    batch["image"],
                    mutable=["batch_stats"],
                )
                loss = optax.softmax_cross_entropy_with_integer_labels(
                    logits.astype(jnp.float32), batch["label"]
                ).mean()
                return loss, updates["batch_stats"]

            (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
            updates, opt_state = tx.update(grads, opt_state, variables["params"])
            params = optax.apply_updates(variables["params"], updates)
            return {"params": params, "batch_stats": stats}, opt_state, loss

        return train_step

    return Workload("ResNet-50", init, batch, 32, step, resnet50_train_flops_per_image())


def _llama2_70b(tensor_parallel: bool, **settings: Any) -> TransformerConfig:
    return TransformerConfig(
        32000, 8192, 64, 80, 28672, 2048, swiglu=True, kv_heads=8,
        tensor_parallel=tensor_parallel, **settings,
    )  # fmt: skip


def _llama31_405b(tensor_parallel: bool = False) -> TransformerConfig:
    """Llama-3.1-405B as its model card gives it: 126 layers, grouped-query attention (8
    K/V heads of 128 query heads), a vocabulary of 128,256; 2,048 tokens per chip as the
    Llama-2 steps here (MaxText's `llama3.1-405b` model)."""
    return TransformerConfig(
        128256, 16384, 128, 126, 53248, 2048, swiglu=True, kv_heads=8,
        tensor_parallel=tensor_parallel,
    )  # fmt: skip


def _plain_gpt2(name: str, cfg: TransformerConfig, cast_first: bool = False) -> Workload:
    from benchmarks.plain_jax_models import gpt2_workload  # it builds on this module

    return gpt2_workload(name, cfg, cast_first)


def _plain_llama(name: str, cfg: TransformerConfig) -> Workload:
    from benchmarks.plain_jax_models import llama_workload  # it builds on this module

    return llama_workload(name, cfg)


#: the models of others' packages, which need the corpus environment (`make .venv-corpus`)
CORPUS_ENVIRONMENT = ("keras-hub-gpt2-medium", "keras-hub-llama3.2-1b", "gemma3-1b", "gemma3-12b")
#: MaxText's model code, which needs MaxText's environment (`benchmarks/maxtext_aot.py`)
MAXTEXT_ENVIRONMENT = ("maxtext-llama2-7b",)


def _from(module: str, key: str) -> Workload:
    """Workload `key` of `benchmarks.<module>`, imported when asked for: it builds on this
    module, and its models' packages may live in an environment of their own."""
    return importlib.import_module(f"benchmarks.{module}").workload(key)


WORKLOADS = {
    "resnet50": _resnet50,
    "bert-large": lambda: language_model(
        "BERT-large",
        TransformerConfig(30522, 1024, 16, 24, 4096, 512, causal=False, batch_per_chip=8),
    ),
    "gpt2-medium": lambda: language_model(
        "GPT-2 medium", TransformerConfig(50257, 1024, 16, 24, 4096, 1024, batch_per_chip=8)
    ),
    # GPT-2 medium as a plain JAX user writes it (`benchmarks.plain_jax_models`)
    "gpt2-medium-plain": lambda: _plain_gpt2(
        "GPT-2 medium plain JAX",
        TransformerConfig(50257, 1024, 16, 24, 4096, 1024, batch_per_chip=8),
    ),
    "gpt2-medium-plain-cast": lambda: _plain_gpt2(
        "GPT-2 medium plain JAX, cast first",
        TransformerConfig(50257, 1024, 16, 24, 4096, 1024, batch_per_chip=8),
        cast_first=True,
    ),
    "llama2-7b-plain": lambda: _plain_llama(
        "Llama-2-7B plain JAX", TransformerConfig(32000, 4096, 32, 32, 11008, 2048, swiglu=True)
    ),
    # keras-hub's own models (`benchmarks.corpus_models`; the corpus environment)
    "keras-hub-gpt2-medium": lambda: _from("corpus_models", "keras-hub-gpt2-medium"),
    "keras-hub-llama3.2-1b": lambda: _from("corpus_models", "keras-hub-llama3.2-1b"),
    "gemma3-1b": lambda: _from("corpus_models", "gemma3-1b"),
    "gemma3-12b": lambda: _from("corpus_models", "gemma3-12b"),
    # Hugging Face's PyTorch model through xla_strategies.torch (`benchmarks.hugging_face_models`)
    "hf-gpt2-medium": lambda: _from("hugging_face_models", "hf-gpt2-medium"),
    "hf-llama3.2-1b": lambda: _from("hugging_face_models", "hf-llama3.2-1b"),
    # MaxText's own model code (`benchmarks.maxtext_models`; MaxText's environment)
    "maxtext-llama2-7b": lambda: _from("maxtext_models", "maxtext-llama2-7b"),
    "llama2-7b": lambda tp=False: language_model(
        "Llama-2-7B",
        TransformerConfig(32000, 4096, 32, 32, 11008, 2048, swiglu=True, tensor_parallel=tp),
    ),
    "llama2-7b-splash": lambda: language_model(
        "Llama-2-7B splash",
        TransformerConfig(32000, 4096, 32, 32, 11008, 2048, swiglu=True, splash=True),
    ),
    "llama2-70b": lambda tp=False: language_model("Llama-2-70B", _llama2_70b(tp)),
    "llama2-70b-minimal": lambda tp=False: language_model(
        "Llama-2-70B minimal remat",
        _llama2_70b(tp, remat_policy="dots_with_no_batch_dims_saveable"),
    ),
    "llama3.1-405b": lambda tp=False: language_model("Llama-3.1-405B", _llama31_405b(tp)),
}
