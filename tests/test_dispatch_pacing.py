"""Step dispatch on CPU devices that share a host's cores is paced (`dispatch_pacing`):
without it, a long loop of small collective steps deadlocks XLA's CPU runtime."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np

import xla_strategies as xs
from tests.helpers import run_script
from xla_strategies.runtime.dispatch_pacing import DispatchPacer

# 3000 steps of a tiny all-reduce, never read back until the end: unpaced, this aborted in
# XLA's rendezvous in every run on a 2-core host (32 programs in flight per device).
_LONG_LOOP = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, numpy as np
    import xla_strategies as xs

    strategy = xs.MirroredStrategy()

    @strategy.compile
    def step(w, x):
        return w - 1e-4 * xs.get_replica_context().all_reduce("mean", jnp.mean(x) * w)

    data = [np.arange(16, dtype=np.float32)]
    x = next(iter(strategy.experimental_distribute_dataset(data)))
    w = jnp.ones(())
    for _ in range(int(sys.argv[1])):
        w = step(w, x)
    print(json.dumps({"w": float(w), "replicas": strategy.num_replicas_in_sync}))
    """
)


def test_a_long_loop_of_small_collective_steps_finishes_and_is_right():
    steps = 3000
    result = run_script(_LONG_LOOP, str(steps), timeout=240)
    # every step multiplies w by 1 - 1e-4 * (the mean of the replicas' means: 7.5)
    assert result["replicas"] == 8
    np.testing.assert_allclose(result["w"], (1 - 1e-4 * 7.5) ** steps, rtol=1e-3)


def test_the_pacer_waits_every_nth_call_for_the_last_outputs(monkeypatch):
    waited = []
    monkeypatch.setattr(jax, "block_until_ready", lambda xs_: waited.append(list(xs_)))
    pacer = DispatchPacer(every=3)
    outputs = [jnp.full((2,), float(i)) for i in range(7)]
    for out in outputs:
        pacer.before_dispatch()
        pacer.after_dispatch([out])
    # calls 3 and 6 wait for the outputs of calls 2 and 5
    assert [[float(a[0]) for a in w] for w in waited] == [[1.0], [4.0]]


def test_the_pacer_skips_outputs_donated_since(monkeypatch):
    waited = []
    monkeypatch.setattr(jax, "block_until_ready", lambda xs_: waited.append(list(xs_)))
    pacer = DispatchPacer(every=1)
    kept, donated = jnp.ones(3), jnp.ones(3)
    pacer.after_dispatch((kept, donated))
    donated.delete()
    pacer.before_dispatch()
    assert waited == [[kept]]


def test_only_cpu_devices_sharing_a_host_are_paced():
    assert xs.MirroredStrategy(jax.devices()[:2]).devices_share_host_cores
    assert not xs.OneDeviceStrategy(jax.devices()[0]).devices_share_host_cores
