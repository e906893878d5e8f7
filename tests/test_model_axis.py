"""A replica spanning several devices (`logical_devices_per_replica`): the mesh ends in a
"model" axis that XLA's partitioner splits each replica's work over, laid out by the
annotations users already write. Numbers in float64 on 8 CPU devices, against
`OneDeviceStrategy` and `nnx.jit`; parameters split over the model axis stay split."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import xla_strategies as xs
from tests.helpers import bytes_on, lm_step
from xla_strategies.cli import main as cli

pytestmark = pytest.mark.usefixtures("float64")


@pytest.fixture
def float64():
    with jax.enable_x64(True):
        yield


# A two-layer MLP, tensor parallel as Megatron splits it: the first layer's columns and
# the second's rows over "model", the hidden activations split on their features.


def _params(strategy=None):
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(4, 16)), "w2": rng.normal(size=(16, 8))}
    if strategy is None:
        return params
    mesh = strategy.mesh
    return {
        "w1": jax.device_put(params["w1"], NamedSharding(mesh, P(None, "model"))),
        "w2": jax.device_put(params["w2"], NamedSharding(mesh, P("model", None))),
    }


def _loss(params, x, y, split=True):
    h = jnp.tanh(x @ params["w1"])
    if split:
        h = jax.lax.with_sharding_constraint(h, P(None, "model"))
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _batches(steps=3):
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(16, 4)), rng.normal(size=(16, 8))) for _ in range(steps)]


def _train(strategy, params, split, **options):
    @strategy.compile(**options)
    def step(params, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y, split)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    for x, y in strategy.experimental_distribute_dataset(_batches()):
        graph = step.executable(params, x, y).graph
        params, loss = step(params, x, y)
    return params, loss, graph, lambda: step.lower(params, x, y).compile()


@pytest.mark.parametrize("k", [2, 4])
def test_a_tensor_parallel_mlp_trains_like_one_device(k):
    want, want_loss, *_ = _train(xs.OneDeviceStrategy(), _params(), split=False)
    strategy = xs.MirroredStrategy(logical_devices_per_replica=k)
    assert strategy.num_replicas_in_sync == 8 // k
    assert dict(strategy.mesh.shape) == {"replica": 8 // k, "model": k}
    got, loss, graph, _ = _train(strategy, _params(strategy), split=True)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12)
    np.testing.assert_allclose(np.mean(loss), want_loss, rtol=1e-12)
    # the weights stay split over the model axis: 1/k of each on every device
    assert got["w1"].sharding.spec == P(None, "model")
    held, whole = bytes_on(got, strategy.devices[0])
    assert held * k == whole
    # the gradients are reduced over the replica axis only
    reductions = [n for n in graph.nodes if n.op == "all_reduce"]
    assert reductions and all(n.attrs["axes"] == ["replica"] for n in reductions)


def test_shard_parameters_splits_over_the_replicas_on_top_of_the_model_split():
    want, *_ = _train(xs.OneDeviceStrategy(), _params(), split=False)
    strategy = xs.MirroredStrategy(logical_devices_per_replica=2)
    got, _, graph, compile_last = _train(
        strategy, _params(strategy), split=True, shard_parameters=True
    )
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12)
    held, whole = bytes_on(got, strategy.devices[0])
    assert held * 8 == whole  # 1/4 per replica, each replica's block split over 2 devices
    assert [a.model_dim for a in graph.io.inputs[:2]] == [1, 0]
    gathers = [n for n in graph.nodes if n.op == "all_gather"]
    assert gathers and all(n.attrs["axes"] == ["replica"] for n in gathers)
    # the gathers over the replicas keep each device's part of the model split: XLA's
    # partitioner gathers nothing whole over the model axis (bridge/partial_manual.py)
    from xla_strategies.hardware.compiled_report import compiled_report

    report = compiled_report(compile_last(), strategy)
    inside = {c.kind for c in report.collectives if c.inside_replica}
    assert inside <= {"all-reduce"}, inside  # Megatron's partial sums only
    # and over the replicas, gathers and scatters of each device's part, not all-reduces of
    # zero-padded blocks (twice the bytes)
    across = {c.kind for c in report.collectives if not c.inside_replica}
    assert across == {"all-gather", "reduce-scatter"}, across


# flax linen: a scanned, rematerialised LM with Megatron's annotations (nn.with_partitioning)


class _Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, _):
        split_columns = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        split_rows = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None))
        h = nn.LayerNorm(param_dtype=jnp.float64)(x)
        h = nn.Dense(self.width * 2, param_dtype=jnp.float64, kernel_init=split_columns)(h)
        h = nn.Dense(self.width, param_dtype=jnp.float64, kernel_init=split_rows)(nn.gelu(h))
        return x + h, None


class _ScannedLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(11, 16, param_dtype=jnp.float64)
        stack = nn.scan(
            nn.remat(_Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
            metadata_params={nn.PARTITION_NAME: None},  # the layer axis is not split
        )
        x, _ = stack(16)(embed(tokens), None)
        return embed.attend(nn.LayerNorm(param_dtype=jnp.float64)(x))


def _train_lm(strategy, params, **options):
    tx = optax.adamw(1e-2)
    step = lm_step(_ScannedLM(), tx)
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 11, size=(16, 7)).astype(np.int32) for _ in range(3)]
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    compiled = strategy.compile(step, **options)
    for tokens in strategy.experimental_distribute_dataset(batches):
        graph = compiled.executable(*state, tokens).graph
        *state, _ = compiled(*state, tokens)
    return state[0], compiled, graph


def _gathered_back(graph) -> list:
    """The all-gathers, in any region, of a value a reduce-scatter there just made (cast
    or constrained on the way): a gradient block gathered whole again."""
    found = []
    for region in graph.graphs():
        blocks = set()
        for node in region.nodes:
            if node.op == "reduce_scatter" or (node.inputs and node.inputs[0] in blocks):
                blocks.update(node.outputs)
            if node.op == "all_gather" and node.inputs[0] in blocks:
                found.append(node)
    return found


@pytest.mark.parametrize(("k", "shard_parameters"), [(2, False), (4, True)])
def test_an_annotated_scanned_linen_lm_trains_like_one_device(k, shard_parameters):
    params = _ScannedLM().init(jax.random.key(0), np.zeros((2, 6), np.int32))["params"]
    want, *_ = _train_lm(xs.OneDeviceStrategy(), nn.meta.unbox(params))
    strategy = xs.MirroredStrategy(logical_devices_per_replica=k)
    got, step, graph = _train_lm(strategy, params, shard_parameters=shard_parameters)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-8)  # adam divides by sqrt(v)
    assert step.cache_size == 1
    kernel = got["ScanCheckpoint_Block_0"]["Dense_0"]["kernel"].value  # (layers, 16, 32)
    held, whole = bytes_on(kernel, strategy.devices[0])
    assert held * (8 if shard_parameters else k) == whole
    # the backward loop returns each layer's gradient block, through the transpose of
    # flax's own sharding constraint, and gathers none of them back whole
    assert not _gathered_back(graph)


# flax NNX: the miniGPT tutorial's annotations, a model built under the strategy's scope


class _FeedForward(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.xavier_uniform()
        zeros = nnx.initializers.zeros_init()
        self.linear1 = nnx.Linear(
            4,
            16,
            kernel_init=nnx.with_partitioning(init, (None, "model")),
            bias_init=nnx.with_partitioning(zeros, ("model",)),
            param_dtype=jnp.float64,
            rngs=rngs,
        )
        self.linear2 = nnx.Linear(
            16,
            8,
            kernel_init=nnx.with_partitioning(init, ("model", None)),
            bias_init=nnx.with_partitioning(zeros, (None,)),
            param_dtype=jnp.float64,
            rngs=rngs,
        )

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def _nnx_train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def _nnx_objects():
    model = _FeedForward(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


@pytest.mark.parametrize(("k", "shard_parameters"), [(2, False), (4, False), (2, True)])
def test_an_annotated_nnx_model_trains_like_nnx_jit_and_stays_split(k, shard_parameters):
    one_device = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(one_device):  # flax needs a mesh to create an annotated variable
        expected, expected_optimizer = _nnx_objects()
        for x, y in _batches():
            nnx.jit(_nnx_train_step)(expected, expected_optimizer, x, y)

    strategy = xs.MirroredStrategy(logical_devices_per_replica=k)
    with strategy.scope():  # the strategy's mesh is the mesh flax creates variables on
        model, optimizer = _nnx_objects()
    step = strategy.compile(_nnx_train_step, shard_parameters=shard_parameters or None)
    for x, y in strategy.experimental_distribute_dataset(_batches()):
        step(model, optimizer, x, y)
    got = jax.tree.leaves(nnx.state(model, nnx.Param))
    for g, w in zip(got, jax.tree.leaves(nnx.state(expected, nnx.Param)), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-8)  # adam divides by sqrt(v)
    assert step.cache_size == 1  # written back as they came: no recompile
    # 1/k of each kernel per device; with shard_parameters, 1/8: the replicas' blocks
    # (rows) of the model axis's split (columns)
    rows = 4 // strategy.num_replicas_in_sync if shard_parameters else 4
    kernel = model.linear1.kernel[...]
    assert kernel.addressable_shards[0].data.shape == (rows, 16 // k)
    moment = optimizer.opt_state[0].mu["linear1"]["kernel"][...]
    assert moment.addressable_shards[0].data.shape == (rows, 16 // k)


# tf.distribute's logical devices on TPUStrategy


def test_tf_logical_devices_split_an_input_over_a_replicas_cores():
    class TwoCoresPerReplica:  # tf's DeviceAssignment, as the strategy reads it
        num_cores_per_replica = 2

    strategy = xs.TPUStrategy(
        "v5e-8", emulate=True, experimental_device_assignment=TwoCoresPerReplica()
    )
    assert strategy.num_replicas_in_sync == 4
    assert strategy.topology.mesh_axes == {"x": 2, "y": 2, "model": 2}
    w = np.arange(12.0).reshape(4, 3)

    def step(x):
        x = strategy.experimental_split_to_logical_devices(x, [1, 2])
        h = strategy.experimental_assign_to_logical_device(x @ w, 1)
        return strategy.experimental_replicate_to_logical_devices(h) * 2

    data = np.arange(32.0).reshape(8, 4)
    batch = next(iter(strategy.experimental_distribute_dataset([data])))
    got = strategy.run(step, args=(batch,))
    np.testing.assert_allclose(np.concatenate(list(got)), data @ w * 2)


def test_tf_logical_device_calls_check_their_arguments():
    strategy = xs.TPUStrategy("v5e-8", emulate=True, logical_devices_per_replica=2)
    data = np.ones((8, 4))
    with pytest.raises(ValueError, match=r"logical_device_id=2 is out of range.*0 to 1"):
        strategy.experimental_assign_to_logical_device(data, 2)
    with pytest.raises(ValueError, match=r"split the tensor into 4 parts.*2 logical devices"):
        strategy.experimental_split_to_logical_devices(data, [2, 2])
    with pytest.raises(ValueError, match="dimension 1 of the tensor .3. does not split"):
        strategy.experimental_split_to_logical_devices(np.ones((8, 3)), [1, 2])
    with pytest.raises(ValueError, match="a positive int for each of the tensor's 2 dimensions"):
        strategy.experimental_split_to_logical_devices(data, [2])
    four = xs.TPUStrategy("v5e-8", emulate=True, logical_devices_per_replica=4)
    with pytest.raises(NotImplementedError, match=r"split dimensions \[0, 1\].*one dimension"):
        four.experimental_split_to_logical_devices(data, [2, 2])


def test_one_logical_device_keeps_tfs_calls_as_they_were():
    strategy = xs.TPUStrategy("v5e-8", emulate=True)

    def step(x):
        x = strategy.experimental_assign_to_logical_device(x, 0)
        x = strategy.experimental_split_to_logical_devices(x, [1, 1])
        return strategy.experimental_replicate_to_logical_devices(x) * 2

    data = np.arange(16.0).reshape(8, 2)
    batch = next(iter(strategy.experimental_distribute_dataset([data])))
    np.testing.assert_array_equal(strategy.run(step, args=(batch,)), (data * 2)[:, None])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: xs.MirroredStrategy(logical_devices_per_replica=3),
            r"=3 does not divide .*'replica' \(8",
        ),
        (
            lambda: xs.MirroredStrategy(logical_devices_per_replica=0),
            "must be a positive int, not 0",
        ),
        (
            lambda: xs.TPUStrategy("v5e-8", emulate=True, logical_devices_per_replica=8),
            r"=8 does not divide .*'y' \(4",
        ),
        (
            lambda: xs.TPUStrategy(
                "v5e-8",
                emulate=True,
                logical_devices_per_replica=4,
                experimental_device_assignment=type("A", (), {"num_cores_per_replica": 2})(),
            ),
            "num_cores_per_replica=2, but logical_devices_per_replica=4",
        ),
    ],
)
def test_a_replica_size_that_does_not_fit_is_a_precise_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_strategies_say_how_many_devices_a_replica_spans():
    tpu = xs.TPUStrategy("v5e-8", emulate=True, logical_devices_per_replica=4)
    assert tpu.num_replicas_in_sync == 2 and tpu.replica_axes == ("x", "y")
    assert dict(tpu.mesh.shape) == {"x": 2, "y": 1, "model": 4}
    assert "logical_devices_per_replica=4" in repr(tpu)
    assert tpu.topology.libtpu_name == "v5e:2x4"  # the slice XLA compiles for is whole
    assert xs.MirroredStrategy().logical_devices_per_replica == 1


def test_the_verifier_rejects_a_collective_over_the_model_axis():
    from xla_strategies.passes.ir.text import parse
    from xla_strategies.passes.ir.verifier import VerificationError, verify

    graph = parse(
        "func @step(%0: f32[4]) {\n"
        '  %1: f32[4] = all_reduce(%0) {"axes": ["model"], "origin": "user", "reduce_op": "sum"}\n'
        "  return %1\n"
        "}\n"
    )
    with pytest.raises(VerificationError, match=r"unknown mesh axis \['model'\]"):
        verify(graph, {"replica": 4})


def test_the_compiled_report_tells_the_partitioners_collectives_from_the_replicas(tmp_path, capsys):
    """A tensor-parallel step compiled by XLA's TPU compiler for v5e-16 with 4 chips per
    replica: collectives whose groups are one replica's 4 consecutive chips are XLA's
    partitioner's; the gradient reduction's groups take one chip of each replica."""
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    from xla_strategies.hardware.compiled_report import compiled_report
    from xla_strategies.hardware.hlo import group_members
    from xla_strategies.hardware.report_text import summary_text

    strategy = xs.TPUStrategy("v5e-16", compile_only=True, logical_devices_per_replica=4)
    mesh = strategy.mesh
    params = {
        "w1": jax.ShapeDtypeStruct(
            (512, 2048), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))
        ),
        "w2": jax.ShapeDtypeStruct(
            (2048, 512), jnp.float32, sharding=NamedSharding(mesh, P("model", None))
        ),
    }
    x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=strategy.split_sharding())

    def step(params, x):
        grads = jax.grad(lambda p: _loss(p, x, 0.0))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    compiled = strategy.compile(step).lower(params, x).compile()
    report = compiled_report(compiled, strategy)
    inside = [c for c in report.collectives if c.inside_replica]
    across = [c for c in report.collectives if not c.inside_replica]
    assert inside and across
    for c in inside:
        for group in group_members(c.kind, f"replica_groups={c.replica_groups}", 16):
            assert sorted(group) == list(range(group[0] // 4 * 4, group[0] // 4 * 4 + 4))
    for c in across:
        for group in group_members(c.kind, f"replica_groups={c.replica_groups}", 16):
            assert len({d % 4 for d in group}) == 1 and len(group) == 4  # one chip of each
    assert "inside replicas" in summary_text(report, "step")
    # the CLI reads the saved text as the step's report does, given the replica's size
    path = tmp_path / "step.hlo.txt"
    path.write_text(compiled.as_text())
    read = ["report", str(path), "--topology", "v5e-16", "--json"]
    assert cli.main([*read, "--logical-devices-per-replica", "4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [c["inside_replica"] for c in printed["collectives"]] == [
        c.inside_replica for c in report.collectives
    ]
    assert printed["estimate"] == report.estimate
    assert cli.main(read) == 0  # without it every chip is a replica: nothing inside one
    assert not any(c["inside_replica"] for c in json.loads(capsys.readouterr().out)["collectives"])
    assert cli.main([*read, "--logical-devices-per-replica", "3"]) == 1
    assert "logical_devices_per_replica=3 does not divide" in capsys.readouterr().err


def test_bf16_gradients_on_cpu_devices_compile_and_match_one_device():
    """XLA's partitioner leaves a copy at the root of a partial-manual reduction, which the
    CPU compiler's bf16 all-reduce promotion aborted on; the strategy leaves that pass out."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    want, *_ = _train(xs.OneDeviceStrategy(), params, split=False)
    strategy = xs.MirroredStrategy(logical_devices_per_replica=2)
    assert "all-reduce-promotion" in strategy.compiler_options()["xla_disable_hlo_passes"]
    got, *_ = _train(strategy, params, split=True)
    for name in want:
        assert got[name].dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(got[name], np.float32),
            np.asarray(want[name], np.float32),
            rtol=0.05,
            atol=0.05,
        )


def test_a_collective_over_every_chip_is_priced_over_the_replicas_and_the_model_axis():
    """MaxText's tensor-parallel programs reduce some values over every chip, several
    replicas' model axes at once: priced over all the topology's axes, not refused."""
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    from xla_strategies.hardware.compiled_report import hlo_report

    strategy = xs.TPUStrategy("v5e-16", compile_only=True, logical_devices_per_replica=4)
    mesh, topology = strategy.mesh, strategy.topology
    every_chip = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, mesh.axis_names), mesh=mesh, in_specs=P(), out_specs=P()
        )
    )
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
    report = hlo_report(every_chip.lower(x).compile().as_text(), topology, 4)
    (reduction,) = report.collectives
    assert reduction.group_size == 16 and not reduction.inside_replica
    replica_axes = [a for a in topology.mesh_axes if a != "model"]
    axes = (*reversed(replica_axes), "model")  # the replicas' fastest first, the model's last
    assert report.estimate["communication_s"] == topology.collective_time(
        "all_reduce", reduction.nbytes, axes, algorithm="flat"
    )


# flax's guide "Scale up Flax Modules on multiple devices": its DotReluDot, as it writes it,
# with mesh axis names and with logical ones


class _DotReluDot(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.xavier_normal()
        y = nn.Dense(
            self.depth,
            kernel_init=nn.with_partitioning(init, (None, "model")),
            use_bias=False,
            param_dtype=jnp.float64,
        )(x)
        y = jax.nn.relu(y)
        w2 = self.param(
            "W2",
            nn.with_partitioning(init, ("model", None)),
            (self.depth, x.shape[-1]),
            jnp.float64,
        )
        return jnp.dot(y, w2)


class _LogicalDotReluDot(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.xavier_normal()
        y = nn.Dense(
            self.depth,
            kernel_init=nn.with_logical_partitioning(init, ("embed", "hidden")),
            use_bias=False,
            param_dtype=jnp.float64,
        )(x)
        y = jax.nn.relu(y)
        y = nn.with_logical_constraint(y, ("batch", "hidden"))
        w2 = self.param(
            "W2",
            nn.with_logical_partitioning(init, ("hidden", "embed")),
            (self.depth, x.shape[-1]),
            jnp.float64,
        )
        return jnp.dot(y, w2)


_RULES = (("batch", None), ("hidden", "model"), ("embed", None))


@pytest.mark.parametrize(
    ("model", "options", "held_share"),
    [
        # parameters and optimizer state held as each device's part: 1/4 per replica,
        # split again over the replica's 2 devices
        (_DotReluDot(64), {"shard_parameters": True}, 8),
        # parameters kept whole across the replicas, each updating its block: only the
        # model axis splits them; each weight's update gathers its own split
        (_DotReluDot(64), {"shard_weight_updates": True, "shard_parameters": False}, 2),
        (_LogicalDotReluDot(64), {"shard_parameters": True}, 8),
    ],
    ids=["shard-parameters", "shard-weight-updates", "logical-axis-names"],
)
def test_flax_guides_dot_relu_dot_moves_each_devices_part_of_equal_shaped_weights(
    model, options, held_share
):
    """Its two weights have one shape, split over the model axis on different dimensions:
    the replicas still gather each device's part of each, and reduce-scatter each device's
    part of each gradient (found through autodiff's transpose of the weight's sharding
    constraint, not by shape), not all-reduces of zero-padded blocks, and train as flax's
    own single-device run does."""
    tx = optax.adam(1e-3)
    with nn.logical_axis_rules(_RULES):
        boxed = model.init(jax.random.key(0), jnp.ones((4, 64), jnp.float64))
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(16, 64)), rng.normal(size=(16, 64))) for _ in range(3)]

    def train_step(params, opt_state, batch):
        x, y = batch
        with nn.logical_axis_rules(_RULES):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(
                params
            )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    want, opt_state = nn.meta.unbox(boxed), tx.init(nn.meta.unbox(boxed))
    for batch in batches:
        want, opt_state, _ = jax.jit(train_step)(want, opt_state, batch)

    from xla_strategies.hardware.compiled_report import compiled_report

    strategy = xs.MirroredStrategy(logical_devices_per_replica=2)
    with nn.logical_axis_rules(_RULES):
        params, opt_state = strategy.replicate(boxed), strategy.replicate(tx.init(boxed))
    step = strategy.compile(train_step, **options)
    for batch in strategy.experimental_distribute_dataset(batches):
        args = (params, opt_state, batch)
        params, opt_state, _ = step(*args)
    for g, w in zip(jax.tree.leaves(nn.meta.unbox(params)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-8)  # adam divides by sqrt(v)
    held, whole = bytes_on(nn.meta.unbox(params)["params"]["W2"], strategy.devices[0])
    assert held * held_share == whole
    report = compiled_report(step.lower(*args).compile(), strategy)
    across = {c.kind for c in report.collectives if not c.inside_replica}
    assert across == {"all-gather", "reduce-scatter"}, across


def test_replicating_logical_axis_names_with_no_rules_in_scope_raises():
    """flax maps no logical name without rules, so the tree would be kept whole over the
    model axis, and its optimizer state laid out unlike its parameters: an error naming
    the leaf, not a silently slower step. A tree already split needs no rules."""
    model = _LogicalDotReluDot(64)
    with nn.logical_axis_rules(_RULES):
        boxed = model.init(jax.random.key(0), jnp.ones((4, 64), jnp.float64))
    strategy = xs.MirroredStrategy(logical_devices_per_replica=2)
    with pytest.raises(ValueError, match=r"\['kernel'\].*logical axis names \('embed', 'hidden'\)"):
        strategy.replicate(optax.adam(1e-3).init(boxed))
    with nn.logical_axis_rules(_RULES):
        params = strategy.replicate(boxed)
    again = strategy.replicate(params)
    assert again["params"]["W2"].value.sharding.spec == P("model")
