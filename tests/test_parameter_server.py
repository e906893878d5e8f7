"""ParameterServerStrategy on a local Ray cluster: placement and partitioners, convergence
with 2 workers and 2 PS tasks, a worker killed mid-step (and restarted), a PS task killed,
and a user error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xla_strategies as xs
from xla_strategies.runtime.parameter_server.placement import Placement

ray = pytest.importorskip("ray")

FEATURES = 16
TRUE_W = np.random.default_rng(0).normal(size=(FEATURES, 1)).astype(np.float32)


def _resolver(workers=2, ps=2):
    cluster = {"chief": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{10 + i}" for i in range(workers)]}
    if ps:
        cluster["ps"] = [f"127.0.0.1:{20 + i}" for i in range(ps)]
    return xs.cluster_resolver.SimpleClusterResolver(cluster, "chief", 0)


def _loss(p, batch):
    return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)


def _grad_step(p, batch):
    loss, grads = jax.value_and_grad(_loss)(p, batch)
    return grads, loss


def _regression(delay=0.0):
    def dataset_fn():
        rng = np.random.default_rng(os.getpid())
        while True:
            time.sleep(delay)
            x = rng.normal(size=(32, FEATURES)).astype(np.float32)
            yield {"x": x, "y": x @ TRUE_W + 0.5}

    return dataset_fn


@pytest.fixture(scope="module")
def cluster():
    yield
    ray.shutdown()


def _setup(partitioner=None, delay=0.0):
    strategy = xs.ParameterServerStrategy(_resolver(), partitioner, devices_per_worker=2)
    params = {"w": np.zeros((FEATURES, 1), np.float32), "b": np.zeros((1,), np.float32)}
    strategy.create_variables(params, optax.sgd(0.1))
    step = strategy.compile(_grad_step)
    coordinator = xs.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(_regression(delay)))

    def worker_fn(it):
        return float(np.mean(step(next(it)))), os.getpid()

    return strategy, coordinator, iterator, worker_fn


def test_partitioners_split_large_variables_and_placement_balances():
    params = {"big": np.zeros((100, 10), np.float32), "small": np.zeros(3, np.float32)}
    placement = Placement.build(params, 2, xs.partitioners.MinSizePartitioner(1000, 4))
    big = [p for p in placement.pieces if p.name.startswith("['big']")]
    assert [p.stop - p.start for p in sorted(big, key=lambda p: p.start)] == [25, 25, 25, 25]
    per_ps = [sum(np.size(a) for a in part.values()) for part in placement.split(params)]
    assert sorted(per_ps) == [500, 503]
    tree = {"big": np.arange(1000.0).reshape(100, 10), "small": np.arange(3.0)}
    jax.tree.map(np.testing.assert_array_equal, placement.join(placement.split(tree)), tree)
    assert xs.partitioners.FixedShardsPartitioner(3)((2, 5), np.float32) == [2, 1]
    with pytest.raises(ValueError, match="max_shards must be a positive integer, got 0"):
        xs.partitioners.MinSizePartitioner(10, 0)


def test_cluster_needs_workers_and_ps():
    with pytest.raises(ValueError, match="at least one 'worker' and one 'ps' task.*got 2 and 0"):
        xs.ParameterServerStrategy(_resolver(ps=0))


def test_an_address_where_nothing_listens_is_an_error_naming_it():
    from tests.multiprocess import free_ports

    (port,) = free_ports(1)
    start = time.monotonic()
    with pytest.raises(
        xs.errors.UnavailableError, match=rf"nothing accepts connections at 127.0.0.1:{port}"
    ):
        xs.ParameterServerStrategy(_resolver(), address=f"127.0.0.1:{port}", connect_timeout=5)
    assert time.monotonic() - start < 10


def test_two_workers_two_ps_converge_with_exact_counts(cluster):
    strategy, coordinator, iterator, worker_fn = _setup(xs.partitioners.FixedShardsPartitioner(2))
    steps = 120
    results = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    losses = [r.fetch()[0] for r in results]
    assert losses[-1] < 1e-3 < losses[0], (losses[0], losses[-1])
    assert len({r.fetch()[1] for r in results}) == 2  # both workers took part
    assert coordinator.completed == steps and strategy.versions() == [steps, steps]
    staleness = strategy.staleness()
    assert sum(staleness.values()) == 2 * steps  # every push recorded, on both PS tasks
    final = strategy.variables()
    np.testing.assert_allclose(final["w"], TRUE_W, atol=1e-2)
    coordinator.shutdown()
    strategy.shutdown()


def test_a_killed_worker_is_retried_elsewhere_and_restarted(cluster):
    strategy, coordinator, iterator, worker_fn = _setup(delay=0.05)
    victim = ray.get(coordinator.workers[0].pid.remote())
    steps = 60
    results = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(steps)]
    deadline = time.monotonic() + 120
    while coordinator.completed < 10:
        assert time.monotonic() < deadline, "no progress before the kill"
        time.sleep(0.01)
    os.kill(victim, signal.SIGKILL)  # mid-step: every step waits in its dataset
    coordinator.join(timeout=180)
    assert coordinator.retried >= 1
    assert coordinator.completed == steps and all(r.done() for r in results)
    assert strategy.versions() == [steps, steps]  # a retried closure is applied once
    restarted = _pid_once_restarted(coordinator.workers[0], timeout=120)
    assert restarted != victim
    # the restarted worker takes closures again: on a loaded machine it may rejoin only
    # after the next few closures have gone to the other one
    deadline, used = time.monotonic() + 300, set()
    while restarted not in used and time.monotonic() < deadline:
        more = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(30)]
        coordinator.join(timeout=120)
        used |= {r.fetch()[1] for r in more}
    assert restarted in used, "the restarted worker was not used again"
    coordinator.shutdown()
    strategy.shutdown()


def _pid_once_restarted(actor, timeout: float) -> int:
    """The actor's pid, asked again while Ray still reports it restarting (a loaded
    machine restarts it more slowly than the closures finish elsewhere)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(actor.pid.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, "the killed worker never came back"
            time.sleep(0.5)


def test_a_user_error_comes_back_and_cancels_the_queue(cluster):
    strategy, coordinator, iterator, worker_fn = _setup(delay=0.02)

    def failing(it, n):
        if n == 5:
            raise ValueError("bad example in batch 5")
        return worker_fn(it)

    results = [coordinator.schedule(failing, args=(iterator, n)) for n in range(40)]
    with pytest.raises(ValueError, match="bad example in batch 5"):
        coordinator.join(timeout=120)
    with pytest.raises(ValueError, match="bad example in batch 5"):
        results[5].fetch()
    cancelled = [r for r in results if r._error is not None and r is not results[5]]
    assert cancelled, "nothing queued was cancelled"
    with pytest.raises(xs.errors.CancelledError, match="an earlier function failed"):
        cancelled[-1].fetch()
    assert coordinator.schedule(worker_fn, args=(iterator,)).fetch(timeout=60)[0] >= 0
    coordinator.shutdown()
    strategy.shutdown()


def test_a_killed_ps_task_is_a_clear_error_and_nothing_hangs(cluster):
    strategy, coordinator, iterator, worker_fn = _setup(delay=0.02)
    coordinator.schedule(worker_fn, args=(iterator,)).fetch(timeout=120)
    os.kill(ray.get(strategy.shards[1].pid.remote()), signal.SIGKILL)
    results = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(10)]
    with pytest.raises(xs.errors.UnavailableError, match="parameter server task ps:1"):
        coordinator.join(timeout=120)
    with pytest.raises(xs.errors.UnavailableError, match="ps:1"):
        results[-1].fetch(timeout=60)
    with pytest.raises(xs.errors.UnavailableError, match="ps:1"):
        coordinator.schedule(worker_fn, args=(iterator,))
    with pytest.raises(xs.errors.UnavailableError, match="ps:1"):
        strategy.variables(timeout=30)
    coordinator.shutdown()


def test_the_example_trains_on_its_own_ray_instance():
    done = subprocess.run(
        [sys.executable, "examples/parameter_server.py", "--steps", "60"],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Ray forwards its workers' log lines to this stdout whenever they arrive, after the
    # summary too: the summary is the last JSON line
    summary = json.loads(next(s for s in reversed(done.stdout.splitlines()) if s.startswith("{")))
    assert summary["completed"] == 60 and summary["updates_per_ps"] == [60, 60]
    assert summary["last_loss"] < 0.5 * summary["first_loss"]


def test_every_step_of_a_closure_counts_and_a_new_coordinator_keeps_updating(cluster):
    strategy, coordinator, iterator, worker_fn = _setup()

    def two_steps(it):
        return worker_fn(it), worker_fn(it)

    for _ in range(5):
        coordinator.schedule(two_steps, args=(iterator,))
    coordinator.join(timeout=120)
    assert strategy.versions() == [10, 10]  # both steps of every closure were applied
    coordinator.shutdown()
    second = xs.ClusterCoordinator(strategy)  # the PS tasks outlive the first coordinator
    second.schedule(worker_fn, args=(iter(second.create_per_worker_dataset(_regression())),))
    second.join(timeout=120)
    assert strategy.versions() == [11, 11]
    unpicklable = (x for x in range(3))
    failed = second.schedule(worker_fn, args=(unpicklable,))
    with pytest.raises(TypeError, match="pickle"):
        second.join(timeout=60)
    with pytest.raises(TypeError, match="pickle"):
        failed.fetch(timeout=10)
    second.shutdown()
    with pytest.raises(xs.errors.CancelledError, match="shut down"):
        second.schedule(worker_fn, args=(iterator,))
    strategy.shutdown()


def test_the_guides_example_trains_asynchronously(tmp_path, monkeypatch):
    """docs/parameter-servers.md's block, as written: two workers and two parameter
    servers; each scheduled step's loss comes back."""
    from tests.test_guides import run_block

    ran = run_block("parameter-servers.md", 0, tmp_path, monkeypatch)
    assert np.isfinite(ran["losses"][-1].fetch())
