"""Machine model: each rank's device (relative speed, memory, node) and the links between them.

    from sparsepipe_hpc.plan.machine import Machine, load_machine
    m = Machine.from_options(ranks=4, speeds="1,1,0.5,0.5", memory="16e9", ranks_per_node=4)
    m.devices[2].speed, m.link(m.devices[0], m.devices[3])     # 0.5, the same-node Link
    m = load_machine("machine.toml")                           # or .json, same keys
    print(m.to_toml())

Written by ``mpirun -n 2 python -m sparsepipe_hpc.plan --measure-machine > machine.toml``
(:func:`measure_links`: an MPI ping-pong, ``alpha + beta * bytes`` fitted by least squares over
message sizes 8 B - 2 MiB; ranks on two nodes measure the across-node link too)::

    ranks_per_node = 4
    device_speed = [1.0, 1.0, 0.5, 0.5]   # relative to the profiled device; one number: all ranks
    device_memory = 16e9                  # bytes per device; a list: one per rank
    cores_per_node = 2                    # CPU ranks only: cores a node's ranks share
    [links.intra]                         # same node
    alpha = 1.5e-06                       # seconds
    beta = 1.0e-10                        # seconds per byte
    [links.inter]                         # across nodes
    alpha = 5.0e-06
    beta = 8.0e-11

Rank ``r`` sits on node ``r // ranks_per_node`` (block placement, as mpirun and srun place ranks
by default). ``cores_per_node`` (absent: every rank has a device of its own, as GPUs do)
describes CPU ranks that share a node's cores: more ranks than cores run at a share of one
(:meth:`Machine.core_share`). With a single ``device_speed``/``device_memory`` the machine
describes any number of ranks, which is how the planner extrapolates to node counts this
machine does not have.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from sparsepipe_hpc.plan.cost import Link
from sparsepipe_hpc.plan.partition import Device

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["Machine", "MachineError", "load_machine", "measure_links", "node_cores",
           "parse_numbers", "DEFAULT_INTRA", "DEFAULT_INTER"]

#: Used when nothing was measured: shared memory on a node, a 100 Gb/s network between nodes.
DEFAULT_INTRA = Link(alpha=2e-6, beta=1 / 10e9)
DEFAULT_INTER = Link(alpha=5e-6, beta=1 / 12.5e9)


class MachineError(ValueError):
    """A machine description (file or options) that breaks a rule."""


def parse_numbers(name: str, text: Union[str, float, Sequence[float]], ranks: int,
                  positive: bool = True) -> list[float]:
    """``"1,1,0.5"`` / ``[1, 1, 0.5]`` / ``1`` -> one float per rank (one value: every rank)."""
    if isinstance(text, str):
        try:
            vals = [float(t) for t in text.split(",")]
        except ValueError:
            raise MachineError(f"{name} must be numbers separated by commas like 1,1,0.5; got "
                               f"{text!r}") from None
    elif isinstance(text, (int, float)):
        vals = [float(text)]
    else:
        vals = [float(t) for t in text]
    for v in vals:
        if not (v > 0 if positive else v >= 0) or math.isnan(v):
            raise MachineError(f"{name}: {v} must be a number > 0; got {text!r}")
    if len(vals) == 1:
        return vals * ranks
    if len(vals) != ranks:
        raise MachineError(f"{name} gives {len(vals)} values but there are {ranks} ranks; give "
                           f"one value per rank or one for all")
    return vals


@dataclass(frozen=True)
class Machine:
    """Devices in rank order and the two link classes (same node, across nodes)."""

    devices: tuple[Device, ...]
    ranks_per_node: int
    intra: Link = DEFAULT_INTRA
    inter: Link = DEFAULT_INTER
    measured: bool = False
    cores_per_node: Optional[int] = None

    def core_share(self, busy_ranks_per_node: float) -> float:
        """Share of a core each busy CPU rank gets: ``min(1, cores_per_node / busy)``.

        ``busy``: ranks of the most crowded node that compute at the same time; a rank waiting
        in MPI yields its core (Open MPI does when oversubscribed), so a pipeline stage idle in
        the bubble does not count (:func:`sparsepipe_hpc.plan.search.evaluate` passes
        ``ranks * (1 - bubble)``). 1 when the machine has no ``cores_per_node`` (GPUs).
        """
        if self.cores_per_node is None or busy_ranks_per_node <= 0:
            return 1.0
        return min(1.0, self.cores_per_node / busy_ranks_per_node)

    def link(self, a: Device, b: Device) -> Link:
        """The link between two devices: ``intra`` on one node, else ``inter``."""
        return self.intra if a.node == b.node else self.inter

    def group_link(self, ranks: Sequence[int]) -> Link:
        """The slowest link a collective over ``ranks`` crosses."""
        nodes = {self.devices[r].node for r in ranks}
        return self.intra if len(nodes) <= 1 else self.inter

    @property
    def ranks(self) -> int:
        return len(self.devices)

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.ranks_per_node)

    def resized(self, ranks: int) -> "Machine":
        """The same machine with ``ranks`` ranks: allowed when every device is alike."""
        if ranks == self.ranks:
            return self
        kinds = {(d.speed, d.memory) for d in self.devices}
        if len(kinds) > 1:
            raise MachineError(f"the machine describes {self.ranks} unequal devices but "
                               f"{ranks} ranks were asked for; describe {ranks} devices or give "
                               f"one device_speed and device_memory for all")
        speed, memory = kinds.pop()
        return Machine.uniform(ranks, self.ranks_per_node, speed, memory, self.intra, self.inter,
                               self.measured, self.cores_per_node)

    @classmethod
    def uniform(cls, ranks: int, ranks_per_node: int, speed: float = 1.0,
                memory: float = math.inf, intra: Link = DEFAULT_INTRA,
                inter: Link = DEFAULT_INTER, measured: bool = False,
                cores_per_node: Optional[int] = None) -> "Machine":
        return cls.build([speed] * ranks, [memory] * ranks, ranks_per_node, intra, inter,
                         measured, cores_per_node)

    @classmethod
    def build(cls, speeds: Sequence[float], memory: Sequence[float], ranks_per_node: int,
              intra: Link = DEFAULT_INTRA, inter: Link = DEFAULT_INTER,
              measured: bool = False, cores_per_node: Optional[int] = None) -> "Machine":
        for name, v in (("ranks_per_node", ranks_per_node), ("cores_per_node", cores_per_node)):
            if (v is not None or name == "ranks_per_node") and (
                    isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v
                    or v < 1):
                raise MachineError(f"{name} is {v!r}; it must be a whole number >= 1")
        devs = tuple(Device(speed=float(s), memory=float(mem), node=r // int(ranks_per_node),
                            name=f"rank {r}")
                     for r, (s, mem) in enumerate(zip(speeds, memory)))
        return cls(devs, int(ranks_per_node), intra, inter, measured,
                   None if cores_per_node is None else int(cores_per_node))

    @classmethod
    def from_options(cls, ranks: int, speeds: Union[str, float, Sequence[float]] = 1.0,
                     memory: Union[str, float, Sequence[float]] = math.inf,
                     ranks_per_node: Optional[int] = None, intra: Link = DEFAULT_INTRA,
                     inter: Link = DEFAULT_INTER) -> "Machine":
        """From ``--device-speed 1,1,0.5,0.5 --device-memory 16e9`` style values."""
        return cls.build(parse_numbers("--device-speed", speeds, ranks),
                         parse_numbers("--device-memory", memory, ranks),
                         ranks_per_node or ranks, intra, inter)

    def to_dict(self) -> dict[str, Any]:
        speeds = [d.speed for d in self.devices]
        mems = [d.memory for d in self.devices]
        mems_out: list[Any] = ["inf" if m == math.inf else m for m in mems]   # strict JSON
        return {"ranks_per_node": self.ranks_per_node,
                "device_speed": speeds[0] if len(set(speeds)) == 1 else speeds,
                "device_memory": mems_out[0] if len(set(mems)) == 1 else mems_out,
                "ranks": self.ranks, "measured": self.measured,
                **({} if self.cores_per_node is None else {"cores_per_node": self.cores_per_node}),
                "links": {"intra": {"alpha": self.intra.alpha, "beta": self.intra.beta},
                          "inter": {"alpha": self.inter.alpha, "beta": self.inter.beta}}}

    def to_toml(self) -> str:
        d = self.to_dict()

        def val(v: Any) -> str:
            if v == "inf":
                return "inf"
            if isinstance(v, list):
                return "[" + ", ".join(val(x) for x in v) + "]"
            if isinstance(v, bool):
                return str(v).lower()
            return "inf" if v == math.inf else repr(v)
        lines = [f"# {'measured' if self.measured else 'assumed'} by sparsepipe_hpc.plan",
                 f"ranks = {d['ranks']}", f"ranks_per_node = {d['ranks_per_node']}",
                 f"device_speed = {val(d['device_speed'])}",
                 f"device_memory = {val(d['device_memory'])}  # bytes",
                 f"measured = {val(self.measured)}"]
        if self.cores_per_node is not None:
            lines.append(f"cores_per_node = {self.cores_per_node}  # CPU cores the node's ranks "
                         f"share")
        for name, link in (("intra", self.intra), ("inter", self.inter)):
            lines += ["", f"[links.{name}]  # {'same node' if name == 'intra' else 'across nodes'}",
                      f"alpha = {link.alpha!r}  # seconds",
                      f"beta = {link.beta!r}  # seconds per byte"]
        return "\n".join(lines) + "\n"


def _from_dict(d: dict[str, Any], where: str, ranks: Optional[int]) -> Machine:
    try:
        n = int(ranks or d.get("ranks") or (len(d["device_speed"])
                                            if isinstance(d.get("device_speed"), list) else 1))
        links = d.get("links", {})
        intra = Link(**links.get("intra", {})) if "intra" in links else DEFAULT_INTRA
        inter = Link(**links.get("inter", {})) if "inter" in links else DEFAULT_INTER
        rpn = int(d.get("ranks_per_node", n))
        speeds = parse_numbers(f"{where}: device_speed", d.get("device_speed", 1.0), n)
        mems = parse_numbers(f"{where}: device_memory", d.get("device_memory", math.inf), n)
        return Machine.build(speeds, mems, rpn, intra, inter, bool(d.get("measured", False)),
                             d.get("cores_per_node"))   # build checks it
    except (TypeError, ValueError) as e:
        if isinstance(e, MachineError) and where in str(e):
            raise
        raise MachineError(f"{where}: {e}; see python -m sparsepipe_hpc.plan --help for the "
                           f"keys (ranks_per_node, device_speed, device_memory, cores_per_node, "
                           f"links)") from None


def load_machine(path: Union[str, os.PathLike[str]], ranks: Optional[int] = None) -> Machine:
    """Read a TOML or JSON machine description; ``ranks`` overrides its rank count."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise MachineError(f"machine file {str(p)!r} cannot be read: {e.strerror}") from None
    try:
        d = json.loads(raw) if p.suffix == ".json" else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise MachineError(f"machine file {str(p)!r} is not valid "
                           f"{'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(d, dict):
        raise MachineError(f"machine file {str(p)!r} must hold a table/object of keys")
    return _from_dict(d, f"machine file {str(p)!r}", ranks)


def _fit(sizes: Sequence[int], secs: Sequence[float]) -> Link:
    """alpha: the smallest message's one-way time, the latency as measured (a fitted intercept
    drowns in the large messages' noise: on a loaded machine it came out negative, so 0);
    beta: the least-squares slope of time over bytes, or where noise made it 0 or less (a
    loaded machine), the largest message's seconds per byte: never an infinite bandwidth."""
    x, y = np.asarray(sizes, float), np.asarray(secs, float)
    beta = float(np.polyfit(x, y, 1)[0])
    if not beta > 0:
        beta = float(y[np.argmax(x)] / x.max())
    return Link(alpha=float(y[np.argmin(x)]), beta=beta)


def _pingpong(comm: Any, a: int, b: int, sizes: Sequence[int], repeats: int) -> list[float]:
    """One-way seconds per message size between ranks a and b (median of half round trips)."""
    rank = comm.Get_rank()
    out = []
    for n in sizes:
        buf = np.zeros(n, dtype=np.uint8)
        times = []
        for _ in range(repeats):
            comm.Barrier()
            if rank == a:
                from mpi4py import MPI
                t0 = MPI.Wtime()
                comm.Send(buf, dest=b, tag=7)
                comm.Recv(buf, source=b, tag=7)
                times.append((MPI.Wtime() - t0) / 2)
            elif rank == b:
                comm.Recv(buf, source=a, tag=7)
                comm.Send(buf, dest=a, tag=7)
        out.append(float(np.median(times)) if times else 0.0)
    return out


#: Ping-pong message sizes in bytes: 8 B to 2 MiB, by factors of 4.
SIZES = (8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288, 2097152)


def measure_links(comm: Any, repeats: int = 20, sizes: Sequence[int] = SIZES
                  ) -> Optional[Machine]:
    """Ping-pong on ``comm`` (at least 2 ranks): a Machine on rank 0, None elsewhere.

    **Collective.** Rank 0 pings rank 1 (same node when both are), and the first rank on another
    node when there is one; without one the across-node link keeps :data:`DEFAULT_INTER`.
    Devices: speed 1 each; memory: the GPU's (CUDA) or this node's RAM divided by its ranks;
    without CUDA, ``cores_per_node``: the cores rank 0's node's ranks may run on (the union of
    their CPU affinities, so a binding of one core per rank still counts the node's cores).
    """
    from mpi4py import MPI

    size = comm.Get_size()
    if size < 2:
        raise MachineError("--measure-machine needs at least 2 ranks for a ping-pong; run "
                           "mpirun -n 2 python -m sparsepipe_hpc.plan --measure-machine")
    names = comm.allgather(MPI.Get_processor_name())
    same = [r for r in range(1, size) if names[r] == names[0]]
    other = [r for r in range(1, size) if names[r] != names[0]]
    intra = inter = None
    if same:
        secs = _pingpong(comm, 0, same[0], sizes, repeats)
        intra = _fit(sizes, secs) if comm.Get_rank() == 0 else None
    if other:
        secs = _pingpong(comm, 0, other[0], sizes, repeats)
        inter = _fit(sizes, secs) if comm.Get_rank() == 0 else None
    memory = _device_memory(names.count(MPI.Get_processor_name()))
    mems = comm.gather(memory, root=0)
    cpus = comm.gather(_cpu_set(), root=0)
    if comm.Get_rank() != 0:
        return None
    per_node = names.count(names[0])
    return Machine.build([1.0] * size, mems, per_node, intra or inter or DEFAULT_INTRA,
                         inter or DEFAULT_INTER, measured=True,
                         cores_per_node=_node_cores(names, cpus))


def node_cores(comm: Any) -> Optional[int]:
    """The cores rank 0's node's ranks may run on, the union of their CPU affinities (a binding
    of one core per rank still counts the node's cores); None where any of them sees a CUDA
    device (a device per rank, no cores shared). **Collective**; the same on every rank."""
    from mpi4py import MPI

    names = comm.allgather(MPI.Get_processor_name())
    return _node_cores(names, comm.allgather(_cpu_set()))


def _cpu_set() -> Optional[set[int]]:
    """The cores this process may run on; None with a CUDA device (a device per rank)."""
    try:
        import torch
        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def _node_cores(names: Sequence[str], cpus: Sequence[Optional[set[int]]]) -> Optional[int]:
    """Cores of rank 0's node: the union of its ranks' CPU sets; None if any has a GPU."""
    mine = [c for n, c in zip(names, cpus) if n == names[0]]
    if any(c is None for c in mine):
        return None
    return len(set().union(*[c for c in mine if c is not None])) or None


def _device_memory(local_ranks: int) -> float:
    try:
        import torch
        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    except Exception:  # noqa: BLE001 - a broken CUDA setup falls back to host memory
        pass
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return math.inf
    return float(total) / max(1, local_ranks)
