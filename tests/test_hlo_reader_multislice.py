"""The reader on multislice TPU programs. XLA's TPU compiler compiles one program per slice
and hands what crosses the slices to the DCN runtime as host transfers (`send`/`recv`
pairs), outside the HLO's collective instructions. The reader once left them out: every
byte over DCN was free. Each spelling of a transfer is read, on every tested JAX release's
own compile, and priced over the slices' DCN."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from tests.helpers import jit_sgd_hlo
from xla_strategies.hardware.compiled_report import hlo_report, step_estimate
from xla_strategies.hardware.hlo import HloReadError, count_hlo_collectives, dcn_collective
from xla_strategies.hardware.hlo_collectives import total_cycles
from xla_strategies.hardware.report_text import summary_text
from xla_strategies.hardware.topology import Topology

pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")

_RUNTIME = '_xla_host_transfer_handler_name="xla_megascale_runtime"'


@pytest.mark.parametrize(
    ("target", "transfer", "found"),
    [
        ('"{1,2}x{0:255}"', "ALL_REDUCE", ("all-reduce", 2)),
        ('"{1,2,3,4}x{0:3}"', "REDUCE_SCATTER", ("reduce-scatter", 4)),
        (
            "{{100000,200000,300000,400000},{100001,200001,300001,400001}}",
            "ALL_TO_ALL",
            ("all-to-all", 4),
        ),
        ("{{100000,300000},{100001,300001}}", "ALL_GATHER", ("all-gather", 2)),
        ("{{100000->300000},{300000->100000}}", "ONE_TO_ONE", ("collective-permute", 2)),
    ],
)
def test_every_spelling_of_a_cross_slice_transfer_gives_its_kind_and_slices(
    target, transfer, found
):
    rest = (
        f"%after-all), channel_id=1, is_host_transfer=true, frontend_attributes={{{_RUNTIME},"
        f'_xla_megascale_target={target},_xla_megascale_transfer_type="{transfer}"}}'
    )
    assert dcn_collective("recv", rest) == found
    assert dcn_collective("send", rest) is None  # a pair counts once, by its recv


def test_a_cross_slice_transfer_the_reader_does_not_know_is_an_error_not_zero():
    rest = '_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="BROADCAST"'
    with pytest.raises(HloReadError, match="%recv.7"):
        dcn_collective("recv", rest, name="%recv.7")
    assert dcn_collective("recv", f"%after-all), is_host_transfer=true, {_RUNTIME}") is None


@pytest.fixture(scope="module")
def two_slice_sgd_hlo():
    """Plain `jax.jit` data parallelism over two v5e-4 slices, as this release compiles it."""
    from jax.experimental import topologies

    devices = topologies.get_topology_desc("v5e:2x2", "tpu", num_slices=2).devices
    return jit_sgd_hlo(jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("dcn", "data")))


def test_a_gradient_summed_across_slices_is_read_and_priced_over_dcn(two_slice_sgd_hlo):
    text = two_slice_sgd_hlo
    topology = Topology.from_name("2xv5e-4")
    found = hlo_report(text, topology)
    across = [c for c in found.collectives if c.across_slices]
    # the 4 MiB gradient, scattered over a slice's 4 chips, each quarter summed between the
    # two slices: 1 MiB per chip over DCN
    assert [(c.kind, c.group_size) for c in across] == [("all-reduce", 2)]
    assert across[0].nbytes == 4 * 2**20 // 4 and across[0].asynchronous
    assert across[0].replica_groups == "{1,2}x{0:3}"
    # XLA's hierarchy: scattered in each slice, the shards summed across, gathered back;
    # the cost model's flat all-reduce across slices is priced as the same three steps
    inside = sorted((c.kind, c.nbytes) for c in found.collectives if not c.across_slices)
    assert inside == [("all-gather", 4 * 2**20), ("reduce-scatter", 2**20)]
    flat = topology.collective_time("all_reduce", 4 * 2**20, algorithm="flat")
    assert found.estimate["communication_s"] == pytest.approx(flat, rel=1e-9)
    assert count_hlo_collectives(text)["all-reduce"] == 1 + sum(
        c.kind == "all-reduce" for c in found.collectives if not c.across_slices
    )
    dcn_only = dataclasses.replace(found, collectives=across)
    dcn = step_estimate(dcn_only, topology, total_cycles(text))["communication_s"]
    # at least the bytes at the DCN's rate per chip: 25 GB/s per host of 8 chips
    assert dcn >= 2**20 / (25e9 / 8)
    assert found.estimate["communication_s"] > dcn
    assert "across slices     all-reduce x1 (1,048,576 B)" in summary_text(found, "sgd")


def test_a_multislice_program_read_as_one_slice_is_an_error(two_slice_sgd_hlo):
    with pytest.raises(HloReadError, match=r"across 2 slices, but v5e-4 is one slice"):
        hlo_report(two_slice_sgd_hlo, Topology.from_name("v5e-4"))


def test_a_collective_inside_a_stage_is_priced_over_its_slice_not_the_stages():
    """Pipeline stages are cut from the slices, yet the stage axis sits last in the mesh
    (before a model axis). A gather over one slice's 16 chips is priced over that slice's
    torus, as on the topology without stages: it was priced over the DCN stage axis too,
    2x the time for Llama-2-7B's layers on 2xv5e-16."""
    from xla_strategies.hardware.compiled_report import collective_seconds
    from xla_strategies.hardware.hlo_collectives import Collective

    flat = Topology.from_name("2xv5e-16")
    staged = flat.split_stage_axis(2)
    assert [a.name for a in staged.axes][-1] == "stage"
    gather = Collective(
        kind="all-gather",
        name="all-gather.1",
        computation="main",
        times=1,
        nbytes=90 * 2**20,
        group_size=16,
        replica_groups="{{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}",
        algorithm=None,
        asynchronous=False,
        overlapped_ops=0,
        overlapped_cycles=0,
    )
    seconds = collective_seconds(gather, flat)
    assert collective_seconds(gather, staged) == pytest.approx(seconds)
    over_both = dataclasses.replace(gather, group_size=32)
    assert collective_seconds(over_both, staged) > 1.5 * seconds  # across the stages too
