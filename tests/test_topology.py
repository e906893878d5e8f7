"""Topologies by name, their data files, and what the cost model says about them."""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources

import pytest

import xla_strategies as xs
from xla_strategies.hardware.topology import Topology, known_hardware
from xla_strategies.passes.cost import model as cost_model

BENCHMARKED = ["v4-1024", "v5e-256", "v5p-1024", "v6e-256", "2xv5p-512", "4xdgx-h100"]


@pytest.mark.parametrize(
    ("name", "axes"),
    [
        ("v5e-256", {"x": 16, "y": 16}),
        ("v5e-16", {"x": 4, "y": 4}),
        ("v4-1024", {"x": 8, "y": 8, "z": 8}),
        ("v5p-1024", {"x": 8, "y": 8, "z": 8}),
        ("2xv5p-512", {"dcn": 2, "x": 4, "y": 8, "z": 8}),
        ("dgx-h100", {"local": 8}),
        ("4xdgx-h100", {"host": 4, "local": 8}),
    ],
)
def test_names_give_mesh_axes(name, axes):
    topology = xs.Topology.from_name(name)
    assert topology.mesh_axes == axes
    assert topology.num_devices == __import__("math").prod(axes.values())


def test_bad_names_say_what_is_known():
    with pytest.raises(ValueError, match="unknown slice 'v5e-300'; known v5e slices: v5e-1, v5e-4"):
        xs.Topology.from_name("v5e-300")
    with pytest.raises(
        ValueError, match="unknown hardware 'v9'; known: cpu-gloo, dgx-h100, dgx-h200, v4, v5e"
    ):
        xs.Topology.from_name("v9-8")
    with pytest.raises(ValueError, match="has no axis 'w'"):
        xs.Topology.from_name("v5e-16").collective_time("all_reduce", 1e6, ("w",))
    with pytest.raises(ValueError, match="op must be one of"):
        xs.Topology.from_name("v5e-16").collective_time("broadcast", 1e6)


def _numbers(table: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(table name, key) of every number in a config, nested tables included."""
    found = []
    for key, value in table.items():
        if isinstance(value, dict) and key not in ("sources", "slices"):
            found += _numbers(value, key)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found.append((prefix, key))
    return found


def test_every_number_names_its_source():
    for hardware in known_hardware():
        path = resources.files("xla_strategies.tpu_configs") / f"{hardware}.toml"
        config = tomllib.loads(path.read_text())
        sources = config["sources"]
        assert all(isinstance(v, str) and len(v) > 20 for v in sources.values()), hardware
        for table, key in _numbers(config):
            assert key in sources or table in sources, f"{hardware}: {table}.{key} has no source"
        if "slices" in config:
            assert {"wraparound", "slices", "slice_names", "topology"} & set(sources), hardware


def test_a_multislice_table_wins_on_several_slices_only():
    """v5p's file leaves the label-gradient selects and the loops' wait off (worse on one
    slice) and its `[multislice]` table turns them on (better on two)."""
    one, two = xs.Topology.from_name("v5p-512"), xs.Topology.from_name("2xv5p-512")
    assert not one.reduce_scatters_before_loops and not one.scatter_adds_as_selects
    assert two.reduce_scatters_before_loops and two.scatter_adds_as_selects
    assert two.hbm_bytes == one.hbm_bytes  # the rest is the file's


@pytest.mark.parametrize("name", BENCHMARKED)
def test_estimates_never_beat_the_bound(name):
    topology = xs.Topology.from_name(name)
    for nbytes in (1e3, 1e5, 1e7, 1e9):
        bound = topology.lower_bound("all_reduce", nbytes)
        for algorithm in cost_model.ALGORITHMS:
            assert (
                topology.collective_time("all_reduce", nbytes, algorithm=algorithm) >= bound * 0.999
            )
        for op in ("reduce_scatter", "all_gather"):
            assert topology.collective_time(op, nbytes) >= topology.lower_bound(op, nbytes) * 0.999


def test_inside_a_slice_xlas_collective_uses_every_link_at_every_size():
    """XLA's TPU all-reduce over a 16x16 slice runs over both torus dimensions at once
    (StrategyND in its backend config): nothing a pass builds beats it."""
    links = xs.Topology.from_name("v5e-256").axis_links()
    for nbytes in (4e3, 1e6, 1e9):
        choice, estimates = cost_model.best_algorithm("all_reduce", nbytes, links)
        assert choice == "flat", (nbytes, estimates)
    assert estimates["flat"] < 0.55 * estimates["ordered"]  # both dimensions' links at once
    bound = cost_model.lower_bound("all_reduce", 1e9, links)
    assert estimates["flat"] / bound < 1.05


def test_wraparound_doubles_ring_bandwidth():
    line = xs.Topology.from_name("v5e-64")  # 8x8: no wraparound
    torus = xs.Topology.from_name("v5e-256")  # 16x16: wraparound
    one_axis = 1e9
    t_line = line.collective_time("all_reduce", one_axis, ("x",), algorithm="flat")
    t_torus = torus.collective_time("all_reduce", one_axis, ("x",), algorithm="flat")
    # (p-1)/p differs: 7/8 against 15/16
    assert t_line / t_torus == pytest.approx(2 * (7 / 8) / (15 / 16), rel=0.01)


def test_an_all_to_all_on_a_torus_is_bounded_by_its_bisection():
    """Half of every chip's buffer crosses to the other half of the slice: on a 16x16
    torus, through the 2 x 16 ring links a cut severs, 8 times an all-gather's time once
    bandwidth rules. A switched node has no such cut."""
    torus = xs.Topology.from_name("v5e-256")
    for nbytes in (1e9, 1e10):
        gather = torus.collective_time("all_gather", nbytes, algorithm="flat")
        assert torus.collective_time("all_to_all", nbytes) / gather == pytest.approx(8, rel=0.02)
    # one ring of 4 with wraparound: 2 chips each send half their buffer across a cut, a
    # buffer's bytes each way over the 2 links it severs (the ring's bandwidth); each
    # chip injects 3/4 of its buffer over the same links: the cut is the larger
    (x,) = torus.axis_links(("x",))
    ring = dataclasses.replace(x, size=4)
    assert cost_model.all_to_all_time(1e9, [ring]) == pytest.approx(
        1e9 / ring.ring_bandwidth + 2 * ring.latency
    )
    node = xs.Topology.from_name("dgx-h100")
    gather = node.collective_time("all_gather", 1e9, algorithm="flat")
    assert node.collective_time("all_to_all", 1e9) == pytest.approx(gather, rel=0.01)


def test_gloo_hosts_and_tpu_slices_stay_flat_where_gpu_nodes_decompose():
    """The fitted cpu-gloo profile makes flat win at every size (decomposing measured
    1.9-2.7x slower); across TPU slices XLA's own collective is already hierarchical; GPU
    clusters decompose."""
    flat = [xs.Topology.from_name(name).axis_links() for name in ("2xcpu-gloo", "2xv5p-512")]
    nodes = xs.Topology.from_name("4xdgx-h100").axis_links()
    for nbytes in (1 << 20, 8 << 20, 128 << 20):
        for links in flat:
            assert cost_model.best_algorithm("all_reduce", nbytes, links)[0] == "flat"
        assert cost_model.best_algorithm("all_reduce", nbytes, nodes)[0] != "flat"


def test_a_gpu_mesh_gets_its_nodes_topology_from_the_device_kind():
    one_node = Topology.for_gpu_mesh("NVIDIA H100 80GB HBM3", {"replica": 8})
    assert one_node.mesh_axes == {"replica": 8}
    assert one_node.axes[0].level == "nvlink" and one_node.hbm_bytes == 80 << 30
    nodes = Topology.for_gpu_mesh("NVIDIA H200", {"host": 4, "local": 8})
    assert nodes.mesh_axes == {"host": 4, "local": 8}
    assert [a.level for a in nodes.axes] == ["infiniband", "nvlink"]
    assert nodes.hardware == "dgx-h200" and nodes.slice_count == 4
    # the links' numbers are the node file's, whatever the mesh calls its axes
    named = Topology.from_name("4xdgx-h200")
    assert nodes.collective_time("all_reduce", 1 << 20) == named.collective_time(
        "all_reduce", 1 << 20
    )


def test_an_unknown_or_oversized_gpu_mesh_has_no_topology():
    assert Topology.for_gpu_mesh("NVIDIA H100 PCIe", {"replica": 8}) is None  # other links
    assert Topology.for_gpu_mesh("NVIDIA H100 80GB HBM3", {"replica": 16}) is None
    assert xs.MirroredStrategy().topology is None  # emulated CPU devices: unknown


@pytest.mark.parametrize("name", ["v5e-256", "2xv5p-512", "dgx-h100", "2xdgx-h100"])
def test_every_topology_is_what_the_passes_read(name):
    from xla_strategies.passes.cost.topology_like import TopologyLike

    assert isinstance(Topology.from_name(name), TopologyLike)
    assert isinstance(Topology.from_name(name).split_model_axis(2), TopologyLike)
