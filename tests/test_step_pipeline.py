"""A step's pipeline is composed by one rule (`xla_strategies.step.step_pipeline`): the user's
spec or the default with the strategy's changes, then settings, then forcing options."""

from __future__ import annotations

import dataclasses

import pytest

import xla_strategies as xs
from xla_strategies.passes import DEFAULT_PIPELINE, CombineAllReduces, PassPipeline
from xla_strategies.passes.pipeline import PipelineSpecError, parse_spec
from xla_strategies.passes.registry import PASS_ORDER
from xla_strategies.step.step_pipeline import PipelineOptions, step_pipeline


def _names(pipeline: PassPipeline) -> list[str]:
    return pipeline.enabled_names()


def test_the_default_pipeline_runs_in_the_canonical_order():
    names = [p.name for p in parse_spec(DEFAULT_PIPELINE)]
    assert names == sorted(names, key=PASS_ORDER.index)


def test_strategies_change_the_default_by_declaring_passes():
    default = [p.name for p in parse_spec(DEFAULT_PIPELINE)]
    assert _names(xs.MirroredStrategy().pipeline()) == default
    tpu = xs.TPUStrategy("v5e-8", emulate=True)
    # in the passes' canonical order: before the last six, which split stacked
    # statistics across slices, rewrite the loss's lookup and its gradient, order the
    # reduce-scatters before the loops, materialize the matmuls added after them and
    # inline nested calls
    assert _names(tpu.pipeline()) == [*default[:-6], "decompose-all-reduces", *default[-6:]]
    central = xs.CentralStorageStrategy().pipeline()
    assert "shard-weight-updates" not in [p.name for p in central.passes]
    assert _names(central)[-9:] == [
        "reduce-to-one-device",
        "combine-all-reduces",
        "prefetch-all-gathers",
        "split-stacked-all-reduces",
        "sink-casts-below-lookups",
        "scatter-adds-as-selects",
        "reduce-scatters-before-loops",
        "materialize-early-matmuls",
        "inline-nested-calls",
    ]
    combine = next(p for p in central.passes if isinstance(p, CombineAllReduces))
    assert combine.threshold_bytes == 32 << 20


def test_forcing_options_insert_passes_where_the_canonical_order_puts_them():
    tpu = xs.TPUStrategy("v5e-8", emulate=True)
    written = PassPipeline.from_spec("insert-reductions,combine-all-reduces")
    forced = step_pipeline(tpu, PipelineOptions(written, shard_parameters=True))
    assert _names(forced) == [
        "insert-reductions",
        "shard-parameters",
        "shard-weight-updates",
        "combine-all-reduces",
    ]
    off = step_pipeline(tpu, PipelineOptions(shard_weight_updates=False))
    assert "shard-weight-updates" in off.disabled


def test_options_are_typed_and_kept_through_copies():
    written = parse_spec("combine-all-reduces{threshold-bytes=65536}")[0]
    copied = dataclasses.replace(written, first_bucket_bytes=8)
    assert copied.set_options() == {"threshold_bytes"}  # kept: a field, not a hidden attribute


def test_a_written_option_conflicting_with_a_setting_names_both():
    with pytest.raises(
        PipelineSpecError, match=r"gradient-reduction=mean.*compile\(gradient_reduction=SUM\)"
    ):
        step_pipeline(
            xs.MirroredStrategy(),
            PipelineOptions(
                "insert-reductions{gradient-reduction=mean}", gradient_reduction=xs.ReduceOp.SUM
            ),
        )


def test_the_environment_spec_is_composed_by_the_same_rule(monkeypatch):
    import jax.numpy as jnp

    monkeypatch.setenv("XLA_STRATEGIES_PIPELINE", "insert-reductions")
    strategy = xs.MirroredStrategy()
    step = strategy.compile(lambda x: jnp.sum(x), shard_parameters=False)
    executable = step.executable(strategy.replicate(jnp.ones(4)))
    assert list(executable.pass_stats["pass_seconds"]) == ["insert-reductions"]


def test_a_spec_that_drops_a_strategy_pass_says_so():
    import warnings

    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    tpu = xs.TPUStrategy("v5e-16", compile_only=True)
    with pytest.warns(UserWarning, match=r"without decompose-all-reduces, which TPUStrategy adds"):
        tpu.compile(lambda x: x, pipeline=DEFAULT_PIPELINE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tpu.compile(lambda x: x, pipeline=tpu.pipeline().spec())
