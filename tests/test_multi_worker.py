"""MultiWorkerMirroredStrategy: TF_CONFIG, and real runs of 2 processes x 4 emulated
devices over gloo on loopback: equivalence, per-host input, a killed peer, a missing one."""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from tests.multiprocess import check, run_workers
from xla_strategies.demo import models

STEPS = 10


def _tf_config(cluster, task_type="worker", index=0) -> dict[str, str]:
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    }


def test_tf_config_resolver_reads_the_cluster():
    env = _tf_config(
        {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], "ps": ["h3:1"]}, "worker", 1
    )
    resolver = xs.cluster_resolver.TFConfigClusterResolver(env)
    assert resolver.cluster_spec()["worker"] == ["h1:2222", "h2:2222"]
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.coordinator_address == "h0:2222"  # the chief
    assert resolver.num_processes == 3 and resolver.process_id == 2
    alone = xs.cluster_resolver.SimpleClusterResolver({"worker": ["a:1", "b:2"]}, "worker", 0)
    assert alone.coordinator_address == "a:1" and alone.is_chief


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "TF_CONFIG is not set"),
        ({"TF_CONFIG": "{not json"}, "TF_CONFIG is not valid JSON"),
        (
            {"TF_CONFIG": json.dumps({"task": {"type": "worker", "index": 0}})},
            "TF_CONFIG has no 'cluster' field",
        ),
        (
            {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}})},
            "must have 'type' and 'index'",
        ),
        (
            _tf_config({"worker": ["a:1"]}, "trainer"),
            "unknown task type 'trainer'; known: chief, worker, ps, evaluator",
        ),
        (_tf_config({"worker": ["a:1"]}, "chief"), "task type 'chief' is not in the cluster"),
        (
            _tf_config({"worker": ["a:1"]}, "worker", 3),
            "task index 3 is out of range for 1 worker task",
        ),
        (
            _tf_config({"chief": ["a:1", "b:1"], "worker": ["c:1"]}),
            "at most one chief is allowed, got 2",
        ),
        (_tf_config({"evaluator": ["a:1", "b:1"], "worker": ["c:1"]}), "at most one evaluator"),
        (
            _tf_config({"worker": ["no-port"]}),
            "malformed address 'no-port' in cluster\\['worker'\\]",
        ),
        (_tf_config({"worker": ["a:99999"]}), "malformed address 'a:99999'"),
    ],
)
def test_invalid_tf_config_gives_the_precise_error(env, message):
    with pytest.raises(ValueError, match=message):
        xs.cluster_resolver.TFConfigClusterResolver(env)


def test_communication_options_validate():
    with pytest.raises(ValueError, match="timeout_seconds must be positive"):
        xs.CommunicationOptions(timeout_seconds=0)


def _reference(model: str) -> dict[str, np.ndarray]:
    tx = optax.sgd(0.1)
    if model == "mlp":
        graphdef, params = helpers.mlp()
        history = helpers.train(
            xs.OneDeviceStrategy(),
            models.mlp_train_step(graphdef, tx),
            params,
            tx,
            helpers.mlp_batches(STEPS),
        )
    else:
        graphdef, params, cfg = helpers.transformer()
        history = helpers.train(
            xs.OneDeviceStrategy(),
            models.lm_train_step(graphdef, tx),
            params,
            tx,
            helpers.lm_batches(STEPS, cfg),
        )
    return {
        f"{model}/{jax.tree_util.keystr(p)}": x
        for p, x in jax.tree_util.tree_flatten_with_path(history[-1])[0]
    }


def test_two_workers_train_like_one_device(tmp_path):
    out = tmp_path / "params.npz"
    workers = run_workers(["tests/workers/train.py", "--out", str(out), "--steps", str(STEPS)])
    check(workers)
    assert all(
        "READY MultiWorkerMirroredStrategy(workers=2, num_replicas_in_sync=8)" in w.output
        for w in workers
    )
    result = np.load(out)
    for model in ("mlp", "transformer"):
        for key, expected in _reference(model).items():
            np.testing.assert_allclose(result[key], expected, rtol=1e-5, atol=1e-7, err_msg=key)
    # per-replica state kept stacked across the two hosts: replica r saw rows 2r, 2r+1
    stats = np.zeros((8, 12), np.float32)
    for batch in helpers.mlp_batches(STEPS):
        stats = 0.9 * stats + 0.1 * batch["x"].reshape(8, 2, 12).mean(1)
    np.testing.assert_allclose(result["stats"], stats, rtol=1e-5, atol=1e-6)


def test_two_workers_shard_the_weight_update_like_the_replicated_one(tmp_path):
    """Reduce-scatters and all-gathers across both hosts, the AdamW moments (and, with
    parameter sharding, the parameters) held split over 8 devices in two processes: the
    replicated update's numbers, in float64."""
    out = tmp_path / "sharded.npz"
    check(
        run_workers(
            ["tests/workers/train.py", "--out", str(out), "--steps", "4", "--models", "sharded"]
        )
    )
    result = np.load(out)
    runs = {
        tag: {k.removeprefix(f"sharded={tag}/"): v for k, v in result.items() if f"={tag}/" in k}
        for tag in ("True", "params", "False")
    }
    off = runs.pop("False")
    assert not off.pop("held_sharded").any() and not off.pop("params_held_sharded").any()
    for tag, on in runs.items():
        assert on.keys() - {"held_sharded", "params_held_sharded"} == off.keys(), tag
        assert len(off) >= 19  # params, count, both moments
        held, params_held = on.pop("held_sharded"), on.pop("params_held_sharded")
        assert held.sum() >= len(held) - 2  # the [5] moments stay whole
        assert params_held.sum() == (len(params_held) - 1 if tag == "params" else 0)
        for key, expected in off.items():
            scale = np.max(np.abs(expected), initial=0.0)
            assert np.max(np.abs(on[key] - expected), initial=0.0) <= 1e-12 * scale, key


def test_a_killed_peer_fails_the_survivor_within_the_timeout(tmp_path):
    out = tmp_path / "params.npz"
    start = time.monotonic()
    workers = run_workers(
        [
            "tests/workers/train.py",
            "--out",
            str(out),
            "--steps",
            "200",
            "--models",
            "mlp",
            "--timeout",
            "8",
        ],
        kill=(1, 2),
        timeout=120,
    )
    elapsed = time.monotonic() - start
    survivor, killed = workers
    assert killed.killed_at == 2
    assert survivor.process.returncode != 0
    assert "UnavailableError" in survivor.output and "of 2 stopped" in survivor.output
    assert elapsed < 8 + 40  # the timeout, plus start-up and compile time
    assert not out.exists() and not out.with_suffix(".partial.npz").exists()  # nothing half-written


def test_a_worker_that_never_starts_is_a_timeout_error(tmp_path):
    start = time.monotonic()
    (alone,) = run_workers(
        ["tests/workers/train.py", "--out", str(tmp_path / "p.npz"), "--timeout", "4"],
        start=[0],
        timeout=120,
    )
    assert alone.process.returncode != 0
    assert "DEADLINE_EXCEEDED" in alone.output or "could not join the cluster" in alone.output
    assert time.monotonic() - start < 4 + 40
