"""CentralStorageStrategy: equal to MirroredStrategy on the same data, gradients reduced to
the parameter device (no all-reduce in the compiled program), the tree collectives on their
own, and the pass on IR text."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec

import xla_strategies as xs
from tests import helpers
from tests.filecheck import filecheck
from tests.passes.pass_testing import run_pass
from tests.test_equivalence import STEPS, TOLERANCES, _setup
from xla_strategies.demo import models
from xla_strategies.passes import ReduceToOneDevice, parse, print_graph
from xla_strategies.passes.bridge import tree_collectives


# Every placement of the parameter device (the default, among the compute devices, apart
# from them) on the MLP; the transformer (scanned layers) once, apart from them.
@pytest.mark.parametrize(
    ("model", "devices", "parameter_device"),
    [("mlp", 8, None), ("mlp", 4, 3), ("mlp", 4, 7), ("transformer", 4, 7)],
)
def test_central_storage_matches_mirrored(model, devices, parameter_device):
    with jax.enable_x64(True):
        make_step, params, tx, batches = _setup(model, np.float64)
        compute = list(range(devices))
        central = xs.CentralStorageStrategy(compute, parameter_device)
        got = helpers.train(central, make_step, params, tx, batches)
        want = helpers.train(xs.MirroredStrategy(compute), make_step, params, tx, batches)
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        check = partial(
            np.testing.assert_allclose, err_msg=f"after step {step + 1}", **TOLERANCES[np.float64]
        )
        jax.tree.map(check, a, b)


def test_the_state_lives_on_the_parameter_device_and_gradients_are_reduced_to_it():
    _, params, _, batches = _setup("mlp", np.float32)
    tx = optax.adam(1e-2)  # with optimizer state
    strategy = xs.CentralStorageStrategy(parameter_device=5)
    assert strategy.parameter_device == jax.devices()[5] and strategy.num_replicas_in_sync == 8
    step = strategy.compile(models.mlp_train_step(helpers.mlp()[0], tx))
    state = (strategy.replicate(params), strategy.replicate(tx.init(params)))
    on_parameter_device = {strategy.parameter_device}
    assert all(leaf.devices() == on_parameter_device for leaf in jax.tree.leaves(state))
    batch = next(iter(strategy.experimental_distribute_dataset(batches)))
    graph = step.graph(*state, batch, after="combine-all-reduces")
    assert graph.count_ops("all_reduce") == 0 and graph.count_ops("reduce_to_one") == 1
    assert graph.count_ops("broadcast") == 0  # the new state stays where it was computed
    hlo = step.lower(*state, batch).compile().as_text()
    assert "all-reduce(" not in hlo
    assert hlo.count("collective-permute(") == 3  # log2(8) rounds to the parameter device
    *state, loss = step(*state, batch)
    assert all(leaf.devices() == on_parameter_device for leaf in jax.tree.leaves(state))
    assert loss.shape == (8, 2) and len(loss.devices()) == 8  # per-replica outputs stay put
    *again, _ = step(*state, batch)  # the next step reads the state from there
    assert all(leaf.devices() == on_parameter_device for leaf in jax.tree.leaves(again))


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_tree_collectives_reduce_to_and_broadcast_from_every_root(size):
    mesh = Mesh(np.array(jax.devices()[:size]), ("r",))
    x = np.arange(size * 3, dtype=np.float32).reshape(size, 3) + 1
    for root in range(size):

        @partial(
            jax.shard_map, mesh=mesh, in_specs=PartitionSpec("r"), out_specs=PartitionSpec("r")
        )
        def run(block, root=root):
            reduced = tree_collectives.reduce_to_one(block, "r", size, root, mean=True)
            return tree_collectives.broadcast(reduced, "r", size, root)

        out = np.asarray(jax.jit(run)(x))
        np.testing.assert_allclose(out, np.broadcast_to(x.mean(0), x.shape), err_msg=f"{root=}")


def test_a_parameter_device_outside_the_compute_devices_holds_the_state():
    _, params, _, batches = _setup("mlp", np.float32)
    tx = optax.adam(1e-2)
    strategy = xs.CentralStorageStrategy(compute_devices=[0, 1, 2, 3], parameter_device=7)
    assert strategy.update_device == jax.devices()[0] and strategy.root == 0
    step = strategy.compile(models.mlp_train_step(helpers.mlp()[0], tx))
    state = (strategy.replicate(params), strategy.replicate(tx.init(params)))
    for batch in strategy.experimental_distribute_dataset(batches[:2]):
        *state, _ = step(*state, batch)
        assert {d for leaf in jax.tree.leaves(state) for d in leaf.devices()} == {jax.devices()[7]}
    with pytest.raises(ValueError, match=r"parameter_device=9 is out of range: there are 8"):
        xs.CentralStorageStrategy(parameter_device=9)


BEFORE = """\
func @step(%0: f32[4], %1: f32[4]{replica}, %2: f32[4]{replica}) {
  %3: f32[4] = all_reduce(%1) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "mean"}
  %4: f32[4] = jax.sub(%0, %3)
  %5: f32[4]{replica} = jax.mul(%4, %2)
  %6: f32[4] = all_reduce(%5) {"axes": ["replica"], "origin": "user", "reduce_op": "sum"}
  return %4 loc("output[0]"), %5 loc("output[1]"), %6 loc("output[2]")
}
"""


def test_pass_broadcasts_where_rooted_values_leave():
    changed, after, ctx = run_pass(ReduceToOneDevice(root=2), BEFORE)
    assert changed
    filecheck(  # one broadcast serves the output and the per-replica use
        after,
        """
        CHECK: %[[R:[0-9]+]]: f32[4] = reduce_to_one(%1)
        CHECK-SAME: "root": 2, "size": 8}  // by reduce-to-one-device
        CHECK-NEXT: %[[SUB:[0-9]+]]: f32[4] = jax.sub(%0, %[[R]])
        CHECK-NEXT: %[[B:[0-9]+]]: f32[4] = broadcast(%[[SUB]]) {"axes": ["replica"], "root": 2, "size": 8}
        CHECK-NOT: broadcast
        CHECK: jax.mul(%[[B]], %2)
        CHECK: return %[[B]] loc("output[0]")
        """,
    )
    assert ctx.stats["reduce-to-one-device"] == {"reduced_to_one": 1, "broadcasts": 1}
    unchanged, same, _ = run_pass(ReduceToOneDevice(), BEFORE, mesh={"replica": 1})
    assert not unchanged and same == print_graph(parse(BEFORE))


def test_pass_leaves_a_two_axis_mesh_alone_with_a_remark():
    text = BEFORE.replace("{replica}", "{host,replica}").replace(
        '["replica"]', '["replica", "host"]'
    )
    changed, after, ctx = run_pass(ReduceToOneDevice(), text, mesh={"replica": 4, "host": 2})
    assert not changed and after == print_graph(parse(text))
    assert any("needs a one-axis mesh" in r for r in ctx.remarks)


def test_rooted_outputs_are_marked_instead_of_broadcast_and_round_trip():
    changed, after, _ = run_pass(ReduceToOneDevice(root=2, broadcast_outputs=False), BEFORE)
    assert changed
    # the per-replica use still gets the broadcast; the mirrored output is kept on the root
    assert after.count("= broadcast(") == 1
    assert 'return %4 rooted loc("output[0]"), %6 loc("output[1]")' in after
    assert print_graph(parse(after)) == after
