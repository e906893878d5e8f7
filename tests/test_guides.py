"""Every Python block of the guides under `docs/` runs as written.

A guide's block reads names its prose has introduced (`strategy`, a model, a batch); each
case here sets those up, runs the block, and checks what the block promises. A block with
no case is an error, so a new example cannot go untested. The parameter-server guide's
case lives in `tests/test_parameter_server.py`, which runs by itself (Ray's processes).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

DOCS = Path(__file__).parents[1] / "docs"

_STEP = """
import jax, jax.numpy as jnp, numpy as np, optax
import xla_strategies as xs
tx = optax.adam(1e-2)
init_params = {"w": np.zeros((4,), np.float32)}
xs_rows = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)

def loss_fn(params, x):
    return jnp.mean((x @ params["w"] - 1.0) ** 2)
"""

#: (guide, block number) -> the names its prose introduced, set up before the block runs
SETUPS = {
    ("checkpoints.md", 0): _STEP
    + """
strategy = xs.MirroredStrategy()
params, opt_state = strategy.replicate(init_params), strategy.replicate(tx.init(init_params))

@strategy.compile
def train_step(params, opt_state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

dist_dataset = strategy.experimental_distribute_dataset([xs_rows] * 100)
total = 100  # the manager saves every 100th step
""",
    ("checkpoints.md", 1): _STEP
    + """
strategy = xs.MirroredStrategy()
params, opt_state = strategy.replicate(init_params), strategy.replicate(tx.init(init_params))
iterator = iter(strategy.experimental_distribute_dataset([xs_rows] * 6))
total_steps = 3

@strategy.compile
def train_step(state, x):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss
""",
    ("compiled-step.md", 0): """
import jax, numpy as np
import xla_strategies as xs
strategy = xs.MirroredStrategy()

@strategy.compile
def draw(key):
    {block}
    return jax.random.uniform(dropout_key)

uniforms = draw(jax.random.key(0))
""",
    ("keras.md", 0): """
import numpy as np
import keras
import xla_strategies as xs
strategy = xs.MirroredStrategy()
rng = np.random.default_rng(0)
x, y = rng.normal(size=(256, 8)).astype("float32"), rng.integers(0, 3, size=256)
x_test, y_test = x[:64], y[:64]
""",
    ("model-axis.md", 0): """
import jax
from flax import nnx
import xla_strategies as xs

class MyModel(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.linear = nnx.Linear(8, 16, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(init, (None, "model")))
""",
    ("parameter-servers.md", 0): _STEP
    + """
from xla_strategies.cluster_resolver import SimpleClusterResolver
cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:10", "127.0.0.1:11"],
           "ps": ["127.0.0.1:20", "127.0.0.1:21"]}
resolver = SimpleClusterResolver(cluster, "chief", 0)
params = {"w": np.zeros((256, 512), np.float32), "b": np.zeros((512,), np.float32)}
rows = np.random.default_rng(0).normal(size=(8, 256)).astype(np.float32)

def loss_fn(params, batch):
    return jnp.mean((batch @ params["w"] + params["b"] - 1.0) ** 2)

def dataset_fn():
    while True:
        yield rows
""",
    ("pipelines.md", 0): """
import jax, optax
import xla_strategies as xs
from tests.helpers import ScannedLM
model, tx = ScannedLM(vocab=11, width=16, layers=4, remat=False), optax.sgd(0.1)
""",
    ("pipelines.md", 1): """
import jax, numpy as np, optax
import xla_strategies as xs
from tests.helpers import scanned_lm
params, make_step, _ = scanned_lm(layers=4, remat=False)
tx = optax.sgd(0.1)
train_step = make_step(tx)
batches = [np.random.default_rng(0).integers(0, 11, size=(32, 7)).astype(np.int32)]
""",
    ("pytorch.md", 0): """
import numpy as np, torch
import torch.nn.functional as F
import xla_strategies as xs
strategy = xs.MirroredStrategy()

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

rng = np.random.default_rng(0)
batches = [(rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 3, size=16))
           for _ in range(3)]
""",
    ("tpu-and-gpu.md", 0): "import xla_strategies as xs\n",
    ("tpu-and-gpu.md", 1): _STEP
    + """
strategy = xs.MirroredStrategy()

def train_step(params, x):
    return params, loss_fn(params, x)
""",
    ("tpu-and-gpu.md", 2): _STEP
    + """
def train_step(params, opt_state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init_params)
opt_state = jax.eval_shape(tx.init, params)
""",
}


def _blocks(guide: str) -> list[str]:
    """The guide's Python blocks (indented ones in lists too), but those that say they are
    a sketch (`# sketch: ...` first), e.g. the outline of a pass."""
    text = (DOCS / guide).read_text()
    blocks = [
        textwrap.dedent(body)
        for body in re.findall(r"^ *```python\n(.*?)^ *```", text, re.S | re.M)
    ]
    return [b for b in blocks if not b.startswith("# sketch")]


def run_block(guide: str, number: int, tmp_path: Path, monkeypatch) -> dict:
    """The block run after its setup, in `tmp_path` (blocks write relative paths); a setup
    with a `{block}` line takes the block there, indented as that line is."""
    monkeypatch.chdir(tmp_path)
    setup, block = textwrap.dedent(SETUPS[guide, number]), _blocks(guide)[number]
    at = re.search(r"^( *)\{block\}$", setup, re.M)
    if at:
        setup, block = setup.replace(at.group(0), textwrap.indent(block, at.group(1))), ""
    namespace: dict = {}
    exec(compile(setup, f"setup of docs/{guide} block {number}", "exec"), namespace)
    exec(compile(block, f"docs/{guide} block {number}", "exec"), namespace)
    return namespace


def test_every_block_of_every_guide_has_a_case():
    found = {(path.name, n) for path in DOCS.glob("*.md") for n in range(len(_blocks(path.name)))}
    assert found == set(SETUPS), "a guide's Python block without a case here, or a case left"


def test_checkpoints_save_and_restore_the_trained_state(tmp_path, monkeypatch):
    ran = run_block("checkpoints.md", 0, tmp_path, monkeypatch)
    assert ran["manager"].latest_step() == 100
    np.testing.assert_array_equal(ran["state"]["params"]["w"], ran["params"]["w"])


def test_the_preemption_handler_loop_runs_its_steps(tmp_path, monkeypatch):
    ran = run_block("checkpoints.md", 1, tmp_path, monkeypatch)
    assert ran["handler"].total_run_calls == 3
    assert np.isfinite(ran["loss"]).all()


def test_each_replica_folds_its_id_into_a_key(tmp_path, monkeypatch):
    uniforms = np.asarray(run_block("compiled-step.md", 0, tmp_path, monkeypatch)["uniforms"])
    assert uniforms.shape == (8,) and len(set(uniforms.tolist())) == 8  # a draw per replica


def test_keras_fit_in_the_scope(tmp_path, monkeypatch):
    ran = run_block("keras.md", 0, tmp_path, monkeypatch)
    assert ran["model"].distribute_strategy is ran["strategy"]
    assert ran["model"].predict(ran["x_test"]).shape == (64, 3)


def test_the_model_axis_splits_flax_variables(tmp_path, monkeypatch):
    ran = run_block("model-axis.md", 0, tmp_path, monkeypatch)
    assert dict(ran["strategy"].mesh.shape) == {"replica": 4, "model": 2}
    kernel = ran["model"].linear.kernel.value
    assert kernel.sharding.shard_shape(kernel.shape) == (8, 8)  # split over the model axis


def test_a_pipelined_step_is_declared_for_four_slices(tmp_path, monkeypatch):
    pytest.importorskip("libtpu", reason="the [tpu] extra provides TPU topologies")
    ran = run_block("pipelines.md", 0, tmp_path, monkeypatch)
    assert ran["strategy"].mesh.shape["stage"] == 4


def test_the_unchanged_step_trains_in_two_stages(tmp_path, monkeypatch):
    ran = run_block("pipelines.md", 1, tmp_path, monkeypatch)
    strategy, params, tx = ran["strategy"], ran["params"], ran["tx"]
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    batch = next(iter(strategy.experimental_distribute_dataset(ran["batches"])))
    *_, loss = ran["step"](*state, batch)
    assert np.isfinite(loss).all()


def test_a_torch_model_trains_and_loads_its_state_back(tmp_path, monkeypatch):
    pytest.importorskip("torchax", reason="the [torch] extra provides torchax")
    ran = run_block("pytorch.md", 0, tmp_path, monkeypatch)
    assert np.isfinite(ran["loss"]).all()
    trained = ran["model"].state_dict()["fc1.weight"].numpy()
    assert not np.array_equal(trained, ran["Net"]().state_dict()["fc1.weight"].numpy())


def test_topologies_and_an_emulated_slice(tmp_path, monkeypatch):
    ran = run_block("tpu-and-gpu.md", 0, tmp_path, monkeypatch)
    assert ran["topology"].mesh_axes == {"x": 16, "y": 16}
    assert ran["strategy"].num_replicas_in_sync == 8


def test_a_steps_own_compiler_options(tmp_path, monkeypatch):
    ran = run_block("tpu-and-gpu.md", 1, tmp_path, monkeypatch)
    assert ran["step"].compiler_options == {"xla_enable_async_all_reduce": False}


def test_gpu_nodes_compile_without_gpus(tmp_path, monkeypatch):
    pytest.importorskip("jax_plugins.xla_cuda12", reason="the [gpu] extra provides it")
    from xla_strategies.hardware.compiled_report import compiled_report

    ran = run_block("tpu-and-gpu.md", 2, tmp_path, monkeypatch)
    report = compiled_report(ran["compiled"], ran["node"])
    assert report.platform == "gpu"
    assert [c.kind for c in report.collectives] == ["all-reduce"]  # the gradients, once
