"""Shared test helpers: reference models and a training loop run under any strategy."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx

import xla_strategies as xs
from xla_strategies.demo import models
from xla_strategies.passes.bridge import jax_compat


def mlp(dtype: Any = np.float32) -> tuple[Any, Any]:
    model = models.MLP((12, 32, 32, 5), rngs=nnx.Rngs(0), dtype=dtype)
    return nnx.split(model, nnx.Param)


def transformer(
    dtype: Any = np.float32, **overrides: Any
) -> tuple[Any, Any, models.TransformerConfig]:
    cfg = models.TransformerConfig(dtype=dtype, **overrides)
    graphdef, params = nnx.split(models.TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    return graphdef, params, cfg


def mlp_batches(
    steps: int, batch: int = 16, dtype: Any = np.float32, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch, 12)).astype(dtype),
            "y": rng.integers(0, 5, size=batch).astype(np.int32),
        }
        for _ in range(steps)
    ]


def lm_batches(
    steps: int, cfg: models.TransformerConfig, batch: int = 16, seed: int = 0
) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, cfg.vocab, size=(batch, cfg.seq_len + 1)).astype(np.int32)
        for _ in range(steps)
    ]


def train(
    strategy: xs.Strategy,
    step_fn: Callable[..., Any],
    params: Any,
    tx: optax.GradientTransformation,
    batches: list[Any],
    **compile_options: Any,
) -> list[Any]:
    """Params (as numpy) after every step of training `step_fn` under `strategy`."""
    with strategy.scope():
        state = strategy.replicate(params), strategy.replicate(tx.init(params))
    step = strategy.compile(step_fn, **compile_options)
    history = []
    for batch in strategy.experimental_distribute_dataset(batches):
        *state, _ = step(*state, batch)
        history.append(jax.tree.map(np.asarray, state[0]))
    return history


def max_relative_error(a: Any, b: Any) -> float:
    def leaf(x: np.ndarray, y: np.ndarray) -> float:
        return float(np.max(np.abs(x - y) / np.maximum(np.abs(y), 1e-30)))

    return max(jax.tree.leaves(jax.tree.map(leaf, a, b)))


def run_example(script: str, *args: str, timeout: int = 300) -> str:
    """Run `examples/<script>` from the repository root as a user would; its stdout."""
    return _run_python([f"examples/{script}", *args], timeout=timeout)


def run_script(code: str, *args: str, timeout: int = 300) -> Any:
    """Run `code` in a fresh Python on CPU (its own devices, its own XLA runtime) from the
    repository root; the JSON value it prints last."""
    import json

    out = _run_python(["-c", code, *args], timeout=timeout, env={"JAX_PLATFORMS": "cpu"})
    return json.loads(out.strip().splitlines()[-1])


def _run_python(argv: list[str], *, timeout: int, env: dict[str, str] | None = None) -> str:
    import os
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, *argv],
        cwd=Path(__file__).parents[1],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def assert_close_to_scale(a, b, tol: float) -> None:
    """Every leaf within `tol` of `b`, relative to the leaf's largest magnitude: sums taken
    in another order differ by an ulp of the operands, which an element that cancels to
    near zero (a weight minus its update) would make a large elementwise relative error."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        scale = np.max(np.abs(y), initial=0.0)
        assert np.max(np.abs(x - y), initial=0.0) <= tol * scale, (x, y)


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.width * 2)(h)
        return x + nn.Dense(self.width)(nn.gelu(h)), None


class ScannedLM(nn.Module):
    """Layers under `nn.scan(nn.remat(...))` (`remat=False`: under `nn.scan` alone), an
    embedding tied to the output layer."""

    vocab: int = 11
    width: int = 8
    layers: int = 3
    remat: bool = True
    remat_policy: str | None = None  # a name in jax.checkpoint_policies
    param_axis: int = 0  # the stack's layer axis (MaxText's `param_scan_axis` is 1)

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width)
        x = embed(tokens)
        policy = self.remat_policy and getattr(jax.checkpoint_policies, self.remat_policy)
        stack = nn.scan(
            nn.remat(Block, policy=policy) if self.remat else Block,
            variable_axes={"params": self.param_axis},
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = stack(self.width)(x, None)
        return embed.attend(nn.LayerNorm()(x))


def bytes_on(tree: Any, device: Any) -> tuple[int, int]:
    """(bytes of `tree`'s arrays that `device` holds, bytes of the whole arrays), read from
    the arrays' addressable shards."""
    leaves = jax.tree.leaves(tree)
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
    return held, sum(x.nbytes for x in leaves)


# Parameter sharding's end-to-end tests (tests/test_parameter_sharding*.py)


def clipped_adamw() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def scanned_lm(
    dtype=np.float32,
    vocab=11,
    width=16,
    layers=3,
    remat=True,
    steps=3,
    remat_policy=None,
    param_axis=0,
):
    """A flax linen LM with its layers under nn.scan(nn.remat(...)) and a tied embedding
    (vocab 11 divides by no replica count: the embedding splits on its width), the step
    flax's docs write for it, and its token batches."""
    model = ScannedLM(
        vocab=vocab,
        width=width,
        layers=layers,
        remat=remat,
        remat_policy=remat_policy,
        param_axis=param_axis,
    )
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, vocab, size=(16, 7)).astype(np.int32) for _ in range(steps)]
    params = model.init(jax.random.key(0), batches[0][:, :-1])["params"]
    params = jax.tree.map(lambda x: x.astype(dtype), params)

    return params, lambda tx: lm_step(model, tx), batches


def lm_step(model: nn.Module, tx: optax.GradientTransformation) -> Callable[..., Any]:
    """The train step flax's docs write for a language model: next-token cross-entropy."""

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1])
            labels = tokens[:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def scanned_tanh_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
    """A stack of tanh layers run by `lax.scan` over the stacked weights, and an optax
    update: step(stack, opt_state, x) -> (stack, opt_state)."""

    def step(stack, opt_state, x):
        def loss(stack):
            h, _ = jax.lax.scan(lambda h, w: (jax.numpy.tanh(h @ w), None), x, stack)
            return jax.numpy.mean(h**2)

        updates, opt_state = tx.update(jax.grad(loss)(stack), opt_state, stack)
        return optax.apply_updates(stack, updates), opt_state

    return step


def train_on(strategy, step_fn, params, tx, batches, **options):
    """(params, opt_state) after training on `strategy`, and the compiled step."""
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    step = strategy.compile(step_fn, donate_argnums=(0, 1), **options)
    for batch in strategy.experimental_distribute_dataset(batches):
        *state, _ = step(*state, batch)
    return tuple(state), step


def trains_as_jit(strategy, step_fn, params, tx, batches, **options):
    """The compiled step, after checking that training on `strategy` gives the numbers of
    the library's own single-device run (plain `jax.jit`) up to float32 summation order."""
    state, step = train_on(strategy, step_fn, params, tx, batches, **options)
    reference = params, tx.init(params)
    for tokens in batches:
        *reference, _ = jax.jit(step_fn)(*reference, tokens)
    assert_close_to_scale(state, tuple(reference), 1e-5)
    return state, step


def token_batches(vocab: int = 32, count: int = 3) -> list[np.ndarray]:
    """`count` batches of 16 sequences of 9 token ids below `vocab` (8 to read, 1 more to
    predict)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=(16, 9)).astype(np.int32) for _ in range(count)]


def lm_trains_as_jit(model: nn.Module, tx: optax.GradientTransformation, **options):
    """`trains_as_jit` of the flax docs' language-model step on `MirroredStrategy`, from
    `model`'s initial parameters, over `token_batches()`: (the strategy, the trained
    state, the compiled step, the first per-replica batch)."""
    batches = token_batches()
    params = model.init(jax.random.key(0), batches[0][:, :-1])["params"]
    strategy = xs.MirroredStrategy()
    state, step = trains_as_jit(strategy, lm_step(model, tx), params, tx, batches, **options)
    batch = next(iter(strategy.experimental_distribute_dataset(batches)))
    return strategy, state, step, batch


def held_split(tree, strategy) -> list[bool]:
    return [strategy.is_held_sharded(x) for x in jax.tree.leaves(tree) if x.ndim]


def jit_sgd_hlo(mesh: jax.sharding.Mesh) -> str:
    """The compiled HLO text of plain `jax.jit` data parallelism on `mesh` (a peer's
    program): one SGD step of a replicated 1024x1024 weight on a 256-row batch split over
    every mesh axis; its gradient is 4 MiB."""
    from jax.sharding import NamedSharding, PartitionSpec

    whole, split = PartitionSpec(), PartitionSpec(tuple(mesh.axis_names))
    w = jax.ShapeDtypeStruct((1024, 1024), np.float32, sharding=NamedSharding(mesh, whole))
    x = jax.ShapeDtypeStruct((256, 1024), np.float32, sharding=NamedSharding(mesh, split))
    loss = lambda w, x: jax.numpy.mean(jax.numpy.tanh(x @ w))  # noqa: E731
    sgd = jax.jit(lambda w, x: w - 0.1 * jax.grad(loss)(w, x))
    return sgd.lower(w, x).compile().as_text()


@functools.cache
def one_tpu_chip() -> jax.sharding.NamedSharding:
    """One chip of a compile-only TPU v5e topology, whole: for compiling a plain `jax.jit`
    program with the TPU compiler (the same devices every call, so programs combine)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    chip = topologies.get_topology_desc("v5e:2x2", "tpu").devices[:1]
    return NamedSharding(Mesh(np.array(chip), ("chip",)), PartitionSpec())


def batch_norm_step(
    model: nn.Module, tx: optax.GradientTransformation, rngs: Callable[[], dict] = dict
) -> Callable[..., Any]:
    """flax's train step for a model with BatchNorm statistics, as flax's docs write it:
    step(variables, opt_state, (images, labels)), the statistics the loss's aux; `rngs`
    gives `apply`'s generators (dropout's key), made inside the step."""

    def step(variables, opt_state, batch):
        images, labels = batch

        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": variables["batch_stats"]},
                images,
                train=True,
                rngs=rngs(),
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return {"params": params, "batch_stats": stats}, opt_state, loss

    return step


def jaxpr_equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters."""
    return jax_compat.equations(jaxpr)


#: A whole compiled module with one all-reduce of 32 bytes over 8 devices, as XLA prints it
ALL_REDUCE_HLO = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %ar = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %n = f32[8]{0} negate(f32[8]{0} %ar)
}
"""


def counted_compiles(monkeypatch: Any) -> list[int]:
    """A list that gains an item each time a step's program is compiled for its topology
    (`CompiledStep._compiled_report`), for as long as `monkeypatch` lasts."""
    from xla_strategies.step import compiled_step

    compiles: list[int] = []
    original = compiled_step.CompiledStep._compiled_report

    def counting(self: Any, signature: Any, graph: Any, ctx: Any) -> Any:
        compiles.append(1)
        return original(self, signature, graph, ctx)

    monkeypatch.setattr(compiled_step.CompiledStep, "_compiled_report", counting)
    return compiles
