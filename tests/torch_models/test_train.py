"""PyTorch modules trained by strategy.compile through torchax, against eager torch on one
device (tests/torch_models/models.py computes the data-parallel reference by hand)."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import xla_strategies as xs
import xla_strategies.torch as xst
from tests.frameworks.reference import TOL
from tests.torch_models.models import (
    Net,
    R,
    TinyLM,
    classification_loss,
    eager_data_parallel,
    image_batches,
    lm_loss,
    token_batches,
)
from xla_strategies.passes.ir.text import print_graph

STRATEGIES = {
    "mirrored": lambda: xs.MirroredStrategy(),
    "tpu": lambda: xs.TPUStrategy("v5e-8", emulate=True),
}


def _train(strategy, model, optimizer, loss_fn, batches, after_step=None, **options):
    state = xst.TrainState.create(model, optimizer)

    @strategy.compile(**options)
    def train_step(state, *batch):
        return xst.train_step(state, loss_fn, *batch)

    losses = []
    for batch in strategy.experimental_distribute_dataset(batches):
        state, loss = train_step(state, *batch)
        losses.append(float(strategy.reduce("mean", loss, axis=None)))
        if after_step is not None:
            after_step()
    return state, losses, train_step


def _trained_net(steps, make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1)):
    """`Net` trained `steps` steps on MirroredStrategy: the strategy, the module, its
    optimizer, the state and the compiled step."""
    torch.manual_seed(0)
    model = Net()
    strategy = xs.MirroredStrategy()
    optimizer = make_optimizer(model)
    batches = image_batches(steps)
    state, _, train_step = _train(strategy, model, optimizer, classification_loss, batches)
    return strategy, model, optimizer, state, train_step


def _assert_params_match(state, reference):
    for name, param in reference.named_parameters():
        np.testing.assert_allclose(
            np.asarray(state.params[name]), param.detach().numpy(), **TOL, err_msg=name
        )


# strategy, and whether the model's BatchNorm layers are converted to SyncBatchNorm
BATCHNORMS = {
    "mirrored": (STRATEGIES["mirrored"], False),
    "tpu": (STRATEGIES["tpu"], False),
    "mirrored-syncbn": (STRATEGIES["mirrored"], True),
}


@pytest.mark.parametrize("case", BATCHNORMS)
def test_cnn_with_batchnorm_and_sgd_momentum_matches_eager_torch(case):
    """BatchNorm keeps each replica's statistics, as under DDP; SyncBatchNorm equals
    BatchNorm on one device over the whole batch, its statistics the same everywhere."""
    make_strategy, sync = BATCHNORMS[case]
    torch.manual_seed(0)
    model = Net()
    batches = image_batches(3)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)

    reference, buffers, ref_losses = eager_data_parallel(
        model, sgd, classification_loss, batches, replicas=1 if sync else R
    )
    trained = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model)) if sync else model
    state, losses, _ = _train(make_strategy(), trained, sgd(trained), classification_loss, batches)

    np.testing.assert_allclose(losses, ref_losses, **TOL)
    _assert_params_match(state, reference)
    for name in ("bn1.running_mean", "bn2.running_var"):
        expected = np.stack([b[name].numpy() for b in buffers])
        expected = expected[0] if sync else expected  # one value, or one per replica
        assert state.buffers[name].shape == expected.shape
        np.testing.assert_allclose(np.asarray(state.buffers[name]), expected, **TOL)
    assert int(np.asarray(state.buffers["bn1.num_batches_tracked"])) == 3
    # the user's module is untouched by training: its values are the state's to hand back
    assert float(trained.bn1.running_var.sum()) == 6.0


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _tied_lm_with_adamw(strategy, **options):
    """TinyLM (a tied embedding) trained 3 AdamW steps on `strategy` and in eager torch,
    whose losses and parameters it must match: (the state, the module it started from)."""
    torch.manual_seed(0)
    model = TinyLM()
    batches = token_batches(3)
    reference, _, ref_losses = eager_data_parallel(model, _adamw, lm_loss, batches)
    state, losses, _ = _train(strategy, model, _adamw(model), lm_loss, batches, **options)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    _assert_params_match(state, reference)
    return state, model


@pytest.mark.parametrize("kind", STRATEGIES)
def test_transformer_with_tied_embedding_and_adamw_matches_eager_torch(kind):
    strategy = STRATEGIES[kind]()
    # on the TPU topology the weight update is sharded (asked for: the cost model would keep
    # these tiny tensors whole, each smaller than one tile per device): AdamW's moments are
    # held split across the devices, and still give eager torch's numbers
    options = {"shard_weight_updates": True} if kind == "tpu" else {}
    state, model = _tied_lm_with_adamw(strategy, **options)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    held = sum(strategy.is_held_sharded(x) for x in moments)
    assert held >= len(moments) // 2 if kind == "tpu" else held == 0
    assert "decoder.weight" not in state.params  # tied: one parameter, one gradient
    # the optimizer state converts back to torch's format and loads into the optimizer
    optimizer = _adamw(copy.deepcopy(model))
    optimizer.load_state_dict(state.optimizer_state_dict())
    assert optimizer.state_dict()["state"][0]["step"] == 3


def test_parameter_sharding_holds_the_torch_state_split_and_matches_eager_torch():
    """`shard_parameters=True` on a torch module's `xst.TrainState`: the parameters are
    held split across the replicas, with eager torch's numbers."""
    strategy = xs.MirroredStrategy()
    state, _ = _tied_lm_with_adamw(strategy, shard_parameters=True)
    params = [x for x in jax.tree.leaves(state.params) if x.ndim]
    assert sum(strategy.is_held_sharded(x) for x in params) >= len(params) // 2


def test_gradient_clipping_where_torch_users_clip_matches_eager_torch():
    """Eager torch clips between `loss.backward()` and `optimizer.step()`; the compiled
    step takes that as `max_grad_norm`, a norm the unclipped gradients exceed."""
    torch.manual_seed(0)
    model = TinyLM()
    batches = token_batches(3)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.5)

    clipped, _, ref_losses = eager_data_parallel(model, sgd, lm_loss, batches, max_grad_norm=0.1)
    unclipped, _, _ = eager_data_parallel(model, sgd, lm_loss, batches)
    state = xst.TrainState.create(model, sgd(model))
    strategy = xs.MirroredStrategy()
    step = strategy.compile(lambda s, *b: xst.train_step(s, lm_loss, *b, max_grad_norm=0.1))
    losses = []
    for batch in strategy.experimental_distribute_dataset(batches):
        state, loss = step(state, *batch)
        losses.append(float(strategy.reduce("mean", loss, axis=None)))
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    _assert_params_match(state, clipped)
    weight = "embed.weight"
    moved = np.abs(unclipped.state_dict()[weight].numpy() - clipped.state_dict()[weight].numpy())
    assert moved.max() > 1e-3  # the clip changed the training


def test_clipping_inside_the_loss_function_is_an_error():
    """Inside loss_fn no gradients exist (in eager torch either): clipping there would
    clip nothing, so it raises and names the place to clip."""
    model = TinyLM()
    state = xst.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def loss_and_clip(module, tokens, targets):
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        return lm_loss(module, tokens, targets)

    strategy = xs.MirroredStrategy()
    step = strategy.compile(lambda s, *b: xst.train_step(s, loss_and_clip, *b))
    batch = next(iter(strategy.experimental_distribute_dataset(token_batches(1))))
    original = torch.nn.utils.clip_grad_norm_
    with pytest.raises(RuntimeError, match="max_grad_norm=... to xst.train_step"):
        step(state, *batch)
    assert torch.nn.utils.clip_grad_norm_ is original  # torch's own again, after the trace
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        strategy.compile(lambda s, *b: xst.train_step(s, lm_loss, *b, max_grad_norm=0))(
            state, *batch
        )


def test_optax_optimizer_matches_torch_sgd():
    import optax

    torch.manual_seed(0)
    model = Net()
    batches = image_batches(2)
    reference, _, _ = eager_data_parallel(
        model, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), classification_loss, batches
    )
    state, _, _ = _train(
        xs.MirroredStrategy(), model, optax.sgd(0.05), classification_loss, batches
    )
    _assert_params_match(state, reference)


def test_apply_outside_a_step_takes_numpy_and_torch_inputs_as_eager_torch_does():
    torch.manual_seed(0)
    model = Net().eval()
    state = xst.TrainState.create(model)
    images = image_batches(1, rows=4, seed=2)[0][0]
    with torch.no_grad():
        expected = model(torch.from_numpy(images)).numpy()
    for given in (images, torch.from_numpy(images), jnp.asarray(images)):
        np.testing.assert_allclose(np.asarray(xst.apply(state, given)), expected, **TOL)


def test_state_dict_round_trips_through_the_module():
    strategy, model, _, state, _ = _trained_net(2)
    trained = Net()
    trained.load_state_dict(state.state_dict())
    trained.eval()
    model.eval()
    images = image_batches(1, rows=8, seed=5)[0][0]

    @strategy.compile
    def predict(state, images):
        return xst.apply(state, images)

    # the folded statistics are the replicas' mean, the parameters are the state's
    np.testing.assert_allclose(
        trained.bn1.running_mean.numpy(),
        np.asarray(state.buffers["bn1.running_mean"]).mean(0),
        **TOL,
    )
    np.testing.assert_array_equal(trained.fc1.weight.detach().numpy(), state.params["fc1.weight"])
    # a state loaded from the module evaluates as the module does in eager torch
    loaded = xst.TrainState.create(Net().eval()).load_state_dict(trained.state_dict())
    batch = next(iter(strategy.experimental_distribute_dataset([images])))
    predicted = np.asarray(predict(loaded, batch))  # per replica: [replicas, rows, classes]
    with torch.no_grad():
        eager = trained(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(predicted.reshape(eager.shape), eager, **TOL)


def test_checkpoint_saves_and_restores_a_torch_state(tmp_path):
    strategy, model, optimizer, state, _ = _trained_net(
        2, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)
    )
    with xs.CheckpointManager(tmp_path, strategy) as manager:
        manager.save(2, state)
        manager.wait_until_finished()
        # torch optimizers create their state on the first step: restore into a state of
        # the same structure (here a fresh run's state after its first step)
        fresh, _, _ = _train(strategy, model, optimizer, classification_loss, image_batches(1))
        restored = manager.restore(2, fresh)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(_data(got), _data(want))
    assert restored.module is model and restored.optimizer is optimizer


def _data(array):
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(array))
    return np.asarray(array)


def test_dump_names_reductions_by_state_dict_keys():
    strategy, _, _, state, train_step = _trained_net(0)
    batch = next(iter(strategy.experimental_distribute_dataset(image_batches(1))))
    text = print_graph(train_step.graph(state, *batch, after="combine-all-reduces"))
    for key in ("conv1.weight", "bn1.weight", "fc2.bias"):
        assert key in text


def test_dropout_draws_different_masks_per_replica_and_per_step():
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.5))
    strategy = xs.MirroredStrategy()
    state = xst.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.0))

    def kept(model, x):
        return (model(x) != 0).float().mean(), model(x) != 0

    @strategy.compile
    def step(state, x):
        return xst.train_step(state, kept, x, has_aux=True)

    x = np.ones((8, 4), np.float32)
    masks = []
    for batch in strategy.experimental_distribute_dataset([x, x]):
        state, fraction, mask = step(state, batch)
        masks.append(np.asarray(mask).reshape(8, 64))
        assert 0.3 < float(np.mean(fraction)) < 0.7
    assert len({m.tobytes() for m in masks[0]}) == 8  # each replica its own mask
    assert not np.array_equal(masks[0], masks[1])  # and a new one every step


def test_errors_name_what_was_wrong():
    model = Net()
    with pytest.raises(ValueError, match="not the module's"):
        xst.TrainState.create(model, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        xst.TrainState.create("net")
    strategy = xs.MirroredStrategy()
    state = xst.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))

    @strategy.compile
    def bad_step(state, images, labels):
        return xst.train_step(state, lambda m, x, y: m(x), images, labels)

    with pytest.raises(ValueError, match="scalar loss"):
        bad_step(state, *next(iter(strategy.experimental_distribute_dataset(image_batches(1)))))


def test_state_dict_folds_a_per_replica_integer_only_when_replicas_agree():
    strategy = xs.MirroredStrategy()
    state = xst.TrainState.create(Net())
    per_replica = {
        "agree": jax.device_put(np.full(8, 3, np.int32), strategy.stacked_sharding()),
        "differ": jax.device_put(np.arange(8, dtype=np.int32), strategy.stacked_sharding()),
    }
    buffers = dict(state.buffers, **{"bn1.num_batches_tracked": per_replica["agree"]})
    assert int(state.replace(buffers=buffers).state_dict()["bn1.num_batches_tracked"]) == 3
    buffers["bn1.num_batches_tracked"] = per_replica["differ"]
    with pytest.raises(ValueError, match="bn1.num_batches_tracked holds a different int32"):
        state.replace(buffers=buffers).state_dict()


def test_train_and_eval_modes_and_frozen_parameters_reach_the_compiled_step():
    """Flags a trace reads from the module (`training`, `requires_grad`) are part of the
    state's structure: changing one compiles again instead of reusing a stale program."""
    strategy, model, _, state, train_step = _trained_net(0)
    images = next(iter(strategy.experimental_distribute_dataset([image_batches(1)[0][0]])))

    @strategy.compile
    def predict(state, images):
        return xst.apply(state, images)

    in_training = np.asarray(predict(state, images))
    model.eval()
    in_eval = np.asarray(predict(state, images))
    assert predict.cache_size == 2 and not np.allclose(in_training, in_eval)
    model.train()

    model.fc2.weight.requires_grad_(False)
    batch = next(iter(strategy.experimental_distribute_dataset(image_batches(1))))
    new_state, _ = train_step(state, *batch)
    np.testing.assert_array_equal(new_state.params["fc2.weight"], state.params["fc2.weight"])
    assert not np.array_equal(new_state.params["fc1.weight"], state.params["fc1.weight"])


def test_exact_gelu_trains_as_eager_torch():
    """`nn.GELU()`'s default is the exact GELU (erf), as HF BERT-style models use it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 16), torch.nn.GELU(), torch.nn.Linear(16, 10)
    )
    batches = image_batches(3)

    def make_optimizer(module):
        return torch.optim.SGD(module.parameters(), lr=0.1)

    reference, _, ref_losses = eager_data_parallel(
        model, make_optimizer, classification_loss, batches
    )
    state, losses, _ = _train(
        xs.MirroredStrategy(), model, make_optimizer(model), classification_loss, batches
    )
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    _assert_params_match(state, reference)


def test_a_float64_model_under_x64_steps_adamw_as_eager_torch_does():
    """With x64 on, torch's optimizer computes its bias corrections in double, as eager
    torch does (it reads its float32 step count back as a Python float)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)
    ).double()
    batches = [(x.astype(np.float64), y) for x, y in image_batches(3)]

    def make_optimizer(module):
        return torch.optim.AdamW(module.parameters(), lr=1e-2)

    reference, _, _ = eager_data_parallel(model, make_optimizer, classification_loss, batches)
    with jax.enable_x64(True):
        state, _, _ = _train(
            xs.MirroredStrategy(), model, make_optimizer(model), classification_loss, batches
        )
        for name, param in reference.named_parameters():
            got = np.asarray(state.params[name])
            assert got.dtype == np.float64, name
            np.testing.assert_allclose(got, param.detach().numpy(), rtol=1e-10, atol=1e-12)
