"""Machine model: options, TOML/JSON round trip, link classes, errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sparsepipe_hpc.plan.cost import Link
from sparsepipe_hpc.plan.machine import (DEFAULT_INTER, DEFAULT_INTRA, Machine, MachineError,
                                         load_machine, measure_links, parse_numbers)


def test_options_and_nodes():
    m = Machine.from_options(4, "1,1,0.5,0.5", "16e9", ranks_per_node=2)
    assert [d.speed for d in m.devices] == [1, 1, 0.5, 0.5]
    assert [d.memory for d in m.devices] == [16e9] * 4
    assert [d.node for d in m.devices] == [0, 0, 1, 1] and m.nodes == 2
    assert m.link(m.devices[0], m.devices[1]) == DEFAULT_INTRA
    assert m.link(m.devices[1], m.devices[2]) == DEFAULT_INTER
    assert m.group_link([0, 1]) == DEFAULT_INTRA and m.group_link([0, 3]) == DEFAULT_INTER


def test_toml_and_json_round_trip(tmp_path):
    m = Machine.build([1.0, 2.0, 0.5], [8e9, math.inf, 4e9], 2, Link(1e-6, 1e-10),
                      Link(4e-6, 2e-10), measured=True)
    path = tmp_path / "machine.toml"
    path.write_text(m.to_toml())
    assert load_machine(path) == m
    jpath = tmp_path / "machine.json"
    jpath.write_text(json.dumps(m.to_dict()))
    assert load_machine(jpath) == m


def test_resized_extrapolates_uniform_machines_only(tmp_path):
    m = Machine.uniform(4, 4, speed=1.0, memory=8e9)
    big = m.resized(1024)
    assert big.ranks == 1024 and big.nodes == 256 and big.devices[1023].memory == 8e9
    with pytest.raises(MachineError, match="4 unequal devices but 8 ranks"):
        Machine.from_options(4, "1,1,0.5,0.5").resized(8)
    path = tmp_path / "m.toml"
    path.write_text("ranks_per_node = 4\ndevice_speed = 1.0\ndevice_memory = 2e9\n")
    assert load_machine(path, ranks=16).ranks == 16


@pytest.mark.parametrize("text, words", [
    ("device_speed = [1.0, 2.0]\nranks = 3\n", "gives 2 values but there are 3 ranks"),
    ("device_speed = -1\n", "must be a number > 0"),
    ("ranks_per_node = 0\n", "ranks_per_node is 0"),
    ("device_speed = [1.0\n", "not valid TOML"),
    ("[links.intra]\nalpha = -1\n", "Link.alpha is -1"),
])
def test_bad_files_are_named(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(MachineError, match=words) as info:
        load_machine(path)
    assert "bad.toml" in str(info.value)


def test_bad_options():
    with pytest.raises(MachineError, match="numbers separated by commas"):
        parse_numbers("--device-speed", "1,x", 2)
    with pytest.raises(MachineError, match="cannot be read"):
        load_machine("/nonexistent/machine.toml")


def test_measure_needs_two_ranks():
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("single-process check")
    with pytest.raises(MachineError, match="at least 2 ranks"):
        measure_links(MPI.COMM_SELF)


def test_a_measured_link_takes_its_latency_from_the_smallest_message():
    """A least-squares intercept over 8 B - 2 MiB drowns in the large messages' noise (on a
    loaded machine it came out negative, then 0: free messages); the smallest one's time is the
    latency as measured."""
    from sparsepipe_hpc.plan.machine import _fit

    sizes, secs = [8, 1 << 20, 1 << 21], [3e-6, 6e-5, 1.5e-4]  # the 1 MiB one ran fast
    assert np.polyfit(sizes, secs, 1)[1] < 0                      # the old fit: latency 0
    link = _fit(sizes, secs)
    assert link.alpha == 3e-6 and link.beta > 0


def test_a_measured_link_never_has_infinite_bandwidth():
    """The small messages ran slow on a loaded machine: the slope is negative, and beta was 0
    (free bytes; a planner then moves everything). Its seconds per byte bound it instead."""
    from sparsepipe_hpc.plan.machine import _fit

    sizes, secs = [8, 1 << 20, 1 << 21], [3e-4, 2e-4, 1e-4]
    assert np.polyfit(sizes, secs, 1)[0] < 0
    assert _fit(sizes, secs).beta == pytest.approx(1e-4 / (1 << 21))
