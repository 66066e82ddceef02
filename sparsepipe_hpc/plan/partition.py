"""Exact contiguous stage partition of a block sequence over (possibly unequal) devices.

    from sparsepipe_hpc.plan.partition import (Block, Device, partition_stages,
                                               partition_stages_best_order)
    blocks = [Block(time=4.0), Block(time=1.0), Block(time=1.0), Block(time=2.0)]
    fast, slow = Device(speed=1.0, memory=16e9), Device(speed=0.5, memory=16e9)
    p = partition_stages(blocks, [fast, slow], microbatches=8)
    p.bounds, p.times, p.bottleneck        # (0, 3, 4), (6.0, 4.0), 6.0
    q = partition_stages_best_order(blocks, [slow, fast])   # also picks the device order
    q.order                                # (1, 0): the fast device runs stage 0

Model (BaPipe, arXiv 2012.12544: balanced partition over heterogeneous accelerators). Stage ``s``
of ``S`` runs blocks ``[i, j)`` on device ``s`` (``speed_s`` relative to the reference device the
block times were measured on, ``memory_s`` bytes). Per micro-batch it costs, in seconds::

    f_s(i, j) = (sum(time[i:j]) + extra[i, j]) / speed_s              compute, forward + backward
              + sum(comm[i:j])                                      the blocks' own messages
              + (s > 0)     * 2 * link_{s-1}.time(out_bytes[i - 1])    activation in, gradient out
              + (s < S - 1) * 2 * link_s.time(out_bytes[j - 1])        activation out, gradient in

where ``extra[i, j]`` (seconds on a speed-1 device, default 0) is work a stage pays only because
it starts at block ``i``, such as kernel maps made by an earlier stage that it must rebuild
(:meth:`sparsepipe_hpc.plan.profile.ModelProfile.rebuild_costs`); ``link_s`` joins stages ``s``
and ``s + 1``: a cut after block ``b`` carries ``out_bytes[b]``
forward and a gradient of the same size backward, and point-to-point transfers are blocking (not
overlapped with compute), so both ends of a cut pay for it. ``out_bytes[b]`` must count everything
alive across that cut (U-Net skips passing through, too). Memory of the stage::

    mem_s(i, j) = sum(param_bytes[i:j]) + k_s * sum(act_bytes[i:j]),   k_s = inflight(s, S, m)

with ``param_bytes`` the weights + gradients + optimizer state and ``act_bytes`` the activations a
block keeps for backward per micro-batch; ``k_s`` micro-batches are in flight on stage ``s``
(1F1B: ``min(S - s, m)``; GPipe: ``m``). A stage over its device's memory costs ``f = inf``.

Objective: the pipeline's step time (:func:`~sparsepipe_hpc.plan.cost.pipeline_step_time`),
``sum_s f_s + (m - 1) * max_s f_s``: the fill/drain term and ``m - 1`` slots of the bottleneck.
Dynamic programming over suffixes: ``H`` is the least bottleneck of blocks ``i..B-1`` on stages
``s..S-1``, ``G_T`` the least sum of stage times among splits whose every stage takes at most
``T``::

    H(S, B) = 0,  H(S, i) = inf for i < B,  H(s, i) = min_{j > i} max(f_s(i, j), H(s + 1, j))
    T* = H(0, 0)                                            the least bottleneck
    G_T(S, B) = 0,  G_T(S, i) = inf for i < B,
    G_T(s, i) = min_{j > i, f_s(i, j) <= T} f_s(i, j) + G_T(s + 1, j)
    step = min_T  G_T(0, 0) + (m - 1) * T    over the stage times T >= T* that occur in f

The minimum is exact: a split with bottleneck ``T`` and sum ``sigma`` has ``G_T(0, 0) <= sigma``,
and ``G_T(0, 0) + (m - 1) T`` is never below the step time of the split that attains it. Each
candidate costs ``O(S * B^2)``; the search evaluates them in batches spread over the sorted
candidates and skips the runs between evaluated ones that a bound rules out (``G_T`` never grows
with ``T``: :func:`_best_bottleneck`). With many micro-batches the least bottleneck wins or
nearly; with one the stages run one after the other and the least sum decides. Ties are
broken in this order, deterministically: (1) least step time, where steps within a relative
:data:`STEP_RTOL` of the least tie (with one micro-batch and equal devices every split has the
same sum, up to rounding); (2) least bottleneck; (3) lexicographically smallest boundaries (the
first stage as short as possible), found by walking forward from stage 0 and taking the
smallest ``j`` that attains ``G_T`` (compared exactly).

Tails. The planner's step also pays, once per step after the pipeline, each stage's gradient
all-reduce and optimizer update; the stages do them at once, so the step adds the largest of
each. ``partition_stages(..., tails=[a, u])`` minimises ``pipeline step + sum_k max_s
tail_k[s, i_s, j_s]``, exactly: with thresholds ``A_k`` on the tails, the least pipeline step
among splits whose every stage keeps ``tail_k <= A_k`` (the DP above, on ``f`` set to inf
elsewhere), plus ``sum_k A_k``, is minimised over the tails' values ``A_k``. Thresholds are
tried in increasing order and cut off where ``P0 + sum_k A_k`` (``P0`` the unconstrained
pipeline optimum, which no threshold lowers) reaches the best step found, so a split whose
tails are small costs one or a few DPs; the unconstrained optimum keeps ties.

Worked example (the snippet above, 8 micro-batches; no transfers, no memory limit). Stage 1
(speed 0.5) on blocks ``[i, 4)`` costs ``f_1 = 8, 6, 4`` for ``i = 1, 2, 3``, so ``H(1, i) = 8, 6,
4``; ``H(0, 0) = min(max(4, 8), max(5, 6), max(6, 4)) = 6``. Both ``j = 2`` (times 5, 6) and ``j =
3`` (times 6, 4) reach ``T* = 6``; their steps are ``11 + 7 * 6`` and ``10 + 7 * 6``, so ``j = 3``
wins; a bottleneck of 8 (``j = 1``: times 4, 8) would cost ``12 + 7 * 8``::

    blocks (s at speed 1)   4   1   1   2
    stage 0, speed 1      [ 0   1   2 ]          6 s
    stage 1, speed 0.5                [ 3 ]      4 s     bottleneck 6 s, step 52 s

Device order. :func:`partition_stages` keeps the given order (stage ``s`` on ``devices[s]``).
:func:`partition_stages_best_order` tries every distinct order (identical devices, by
:class:`Device` equality, are interchangeable, so ``S! / prod(n_c!)`` orders for class sizes
``n_c``) and keeps the best by the same rules (steps within :data:`STEP_RTOL` tie, then the least
bottleneck), the first in lexicographic order of classes (numbered by first appearance) on ties. Order matters through speeds, memory (``k_s`` falls along
the pipeline under 1F1B) and links that depend on the two devices (same node or not). It refuses
more than ``max_orders`` orders (default 5040 = 7!; each order costs one DP): group devices into
classes or fix the order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from sparsepipe_hpc.plan.cost import Link, pipeline_step_time

__all__ = ["Block", "Device", "Partition", "PartitionError", "LinkSpec", "InflightFn",
           "inflight_1f1b", "inflight_gpipe", "partition_stages", "partition_stages_best_order",
           "segment_sums", "distinct_orders", "order_count", "STEP_RTOL"]

InflightFn = Callable[[int, int, int], int]
#: Step times within this relative distance of the least are ties (the same times summed in
#: another order differ in their last bits): the least bottleneck among them wins.
STEP_RTOL = 1e-9
LinkSpec = Union[Link, Sequence[Union[Link, Sequence[Link]]], Callable[["Device", "Device"], Link]]


class PartitionError(ValueError):
    """No contiguous stage partition satisfies the constraints, or its inputs are invalid."""


def inflight_1f1b(stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations stage ``s`` (0-based) holds under 1F1B: ``min(S - s, m)``."""
    return min(stages - stage, microbatches)


def inflight_gpipe(stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations every stage holds under GPipe (all forwards first): ``m``."""
    return microbatches


@dataclass(frozen=True)
class Block:
    """One block of the model. time: seconds forward + backward per micro-batch on a speed-1 device;
    out_bytes: bytes crossing a cut right after it; param_bytes: weights + gradients + optimizer
    state; act_bytes: activation bytes kept for backward per micro-batch; comm: seconds per
    micro-batch of the block's own communication (a spatial grid's halo exchanges), which a
    faster device does not shorten."""

    time: float
    out_bytes: float = 0.0
    param_bytes: float = 0.0
    act_bytes: float = 0.0
    name: str = ""
    comm: float = 0.0


@dataclass(frozen=True)
class Device:
    """One accelerator. speed: relative to the reference device (2.0 = twice as fast); memory: bytes
    available for the stage; node: which node it sits on (links may depend on it). ``name`` is a
    label only: devices that differ only in name are interchangeable."""

    speed: float = 1.0
    memory: float = math.inf
    node: int = 0
    name: str = field(default="", compare=False)


@dataclass(frozen=True)
class Partition:
    """A stage partition. Stage ``s`` runs blocks ``range(bounds[s], bounds[s + 1])`` on
    ``devices[s]`` (= input device ``order[s]``); per stage: ``compute`` (its blocks' work and
    ``comm``) + ``transfer`` (to and from the neighbouring stages) = ``times`` (seconds per
    micro-batch), ``memory`` (bytes) with ``inflight`` micro-batches' activations."""

    bounds: tuple[int, ...]
    order: tuple[int, ...]
    devices: tuple[Device, ...]
    compute: tuple[float, ...]
    transfer: tuple[float, ...]
    times: tuple[float, ...]
    memory: tuple[float, ...]
    inflight: tuple[int, ...]
    microbatches: int

    @property
    def bottleneck(self) -> float:
        """The slowest stage's seconds per micro-batch."""
        return max(self.times)

    @property
    def stages(self) -> tuple[range, ...]:
        """The block indices of each stage."""
        return tuple(range(a, b) for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    def step_time(self) -> float:
        """Predicted seconds per step without all-reduce: ``sum t_s + (m - 1) * max t_s``."""
        return pipeline_step_time(self.times, self.microbatches)


def _fmt(nbytes: float) -> str:
    return f"{nbytes:.4g} bytes" + (f" ({nbytes / 2**30:.3g} GiB)" if nbytes >= 2**30 else "")


def _dev(devices: Sequence[Device], k: int) -> str:
    d = devices[k]
    return f"device {k}" + (f" ({d.name!r})" if d.name else "")


def _check_inputs(blocks: Sequence[Block], devices: Sequence[Device], microbatches: int) -> None:
    if not blocks:
        raise PartitionError("blocks is empty; the model needs at least one block")
    if not devices:
        raise PartitionError("devices is empty; a pipeline needs at least one stage")
    for b, blk in enumerate(blocks):
        for attr in ("time", "out_bytes", "param_bytes", "act_bytes", "comm"):
            v = getattr(blk, attr)
            if not isinstance(v, (int, float, np.number)) or not math.isfinite(v) or v < 0:
                raise PartitionError(f"blocks[{b}].{attr} is {v!r}; it must be a finite "
                                     f"number >= 0")
    for k, d in enumerate(devices):
        if not isinstance(d.speed, (int, float, np.number)) or not math.isfinite(d.speed) \
                or d.speed <= 0:
            raise PartitionError(f"devices[{k}].speed is {d.speed!r}; it must be a finite "
                                 f"number > 0")
        if not isinstance(d.memory, (int, float, np.number)) or math.isnan(d.memory) \
                or d.memory <= 0:
            raise PartitionError(f"devices[{k}].memory is {d.memory!r}; it must be > 0 bytes "
                                 f"(math.inf for no limit)")
    if isinstance(microbatches, bool) or int(microbatches) != microbatches or microbatches < 1:
        raise PartitionError(f"microbatches is {microbatches!r}; it must be a whole number >= 1")
    if len(blocks) < len(devices):
        raise PartitionError(f"{len(blocks)} blocks cannot fill {len(devices)} stages (each stage "
                             f"needs at least one block); use at most {len(blocks)} stages or "
                             f"split the model into more blocks")


def _links(link: LinkSpec, devices: Sequence[Device]) -> list[tuple[Link, ...]]:
    """Per stage pair, the links its messages may take (one, or several whose slowest rules)."""
    n = len(devices) - 1
    if isinstance(link, Link):
        out: list[Any] = [link] * n
    elif callable(link):
        out = [link(devices[s], devices[s + 1]) for s in range(n)]
    else:
        out = list(link)
        if len(out) != n:
            raise PartitionError(f"link has {len(out)} entries; {len(devices)} stages need "
                                 f"{n} (one per pair of consecutive stages)")
    pairs = [tuple(ln) if isinstance(ln, (list, tuple)) else (ln,) for ln in out]
    for s, lns in enumerate(pairs):
        if not lns or not all(isinstance(ln, Link) for ln in lns):
            raise PartitionError(f"link for stages {s}-{s + 1} is {out[s]!r}; it must be a Link "
                                 f"or a non-empty list of Links (the slowest is used)")
    return pairs


def _inflight(inflight: InflightFn, stages: int, m: int) -> list[int]:
    ks = [inflight(s, stages, m) for s in range(stages)]
    for s, k in enumerate(ks):
        if isinstance(k, bool) or int(k) != k or k < 0:
            raise PartitionError(f"inflight({s}, {stages}, {m}) returned {k!r}; it must be a "
                                 f"whole number >= 0 of micro-batches")
    return [int(k) for k in ks]


def segment_sums(x: Union[Sequence[float], np.ndarray]) -> np.ndarray:
    """[B] -> [B + 1, B + 1]: entry [i, j] = sum(x[i:j]) for j > i (left to right), else 0."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    out = np.zeros((n + 1, n + 1))
    for i in range(n):
        out[i, i + 1:] = np.cumsum(x[i:])
    return out


class _Tables:
    """Per-block segment sums shared by every device order."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self.n = len(blocks)
        self.time = segment_sums([b.time for b in blocks])
        self.comm = segment_sums([b.comm for b in blocks])
        self.param = segment_sums([b.param_bytes for b in blocks])
        self.act = segment_sums([b.act_bytes for b in blocks])
        self.out = np.array([b.out_bytes for b in blocks], dtype=np.float64)


def _extra(extra: Optional[np.ndarray], n: int) -> np.ndarray:
    if extra is None:
        return np.zeros((n + 1, n + 1))
    e = np.asarray(extra, dtype=np.float64)
    if e.shape != (n + 1, n + 1) or not np.all(np.isfinite(e)) or np.any(e < 0):
        raise PartitionError(f"extra must be a [{n + 1}, {n + 1}] array of finite seconds >= 0 "
                             f"(entry [i, j]: a stage running blocks i..j-1); got shape "
                             f"{e.shape}")
    return e


def _least_sums(f: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """``G_T(0, 0)`` of the module docstring for each ``T`` in ``limits`` ([C] -> [C]): the least
    sum of stage times over splits whose every stage takes at most ``T``."""
    S, n = f.shape[0], f.shape[1] - 1
    G = np.full((len(limits), n + 1), np.inf)
    G[:, n] = 0.0
    for s in range(S - 1, -1, -1):
        G = np.where(f[s][None] <= limits[:, None, None], f[s][None] + G[:, None, :],
                     np.inf).min(axis=2)
    return G[:, 0]


def _best_bottleneck(f: np.ndarray, tstar: float, m: int, batch: int = 64) -> float:
    """The least ``T`` whose ``G_T(0, 0) + (m - 1) T`` is within :data:`STEP_RTOL` of the least
    over the stage times ``T >= T*`` in ``f``: the bottleneck of the split with the least step
    time (module docstring).

    A search over the sorted candidates, ``batch`` at a time, that skips a run of them it can
    bound: ``G_T`` never grows with ``T``, so between evaluated candidates ``a < b`` every step
    is at least ``G_b + (m - 1) T_{a+1}``. A run is skipped where that bound is above the
    tolerance of the least step found (nothing in it is a tie or better) or, after the pick so
    far, where nothing in it could be low enough to make the pick no longer a tie."""
    ts = np.unique(f[np.isfinite(f) & (f >= tstar)])       # sorted; T* first, no limit last
    n = len(ts)
    sums = np.full(n, np.nan)                                # G_T(0, 0) where evaluated

    def evaluate(lo: int, hi: int) -> None:                  # up to `batch` spread over lo..hi
        idx = np.unique(np.linspace(lo, hi, min(batch, hi - lo + 1)).round().astype(np.int64))
        sums[idx] = _least_sums(f, ts[idx])

    evaluate(0, n - 1)
    while True:
        done = np.flatnonzero(~np.isnan(sums))
        steps = sums[done] + (m - 1) * ts[done]
        tie = float(steps.min()) * (1 + STEP_RTOL)
        k = int(np.argmax(steps <= tie))                     # the first within the tolerance
        pick, pick_step = int(done[k]), float(steps[k])
        for a, b in zip(done[:-1].tolist(), done[1:].tolist()):
            if b - a < 2:
                continue
            low = sums[b] + (m - 1) * ts[a + 1]
            if low > tie or (a >= pick and low * (1 + STEP_RTOL) >= pick_step):
                continue
            evaluate(a + 1, b - 1)
            break
        else:
            return float(ts[pick])


def _stage_times(tab: _Tables, devices: Sequence[Device], links: list[tuple[Link, ...]],
                 ks: list[int], extra: Optional[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``[S, B + 1, B + 1]`` arrays of stage ``s`` on blocks ``[i, j)``: compute, transfer,
    memory, and ``f`` (their time; inf for an empty stage or one over its device's memory)."""
    n, S = tab.n, len(devices)
    comp = np.empty((S, n + 1, n + 1))
    xfer = np.zeros((S, n + 1, n + 1))
    mem = np.empty((S, n + 1, n + 1))
    cut = np.r_[0.0, tab.out]     # a cut before block i carries out_bytes[i - 1] (i > 0)
    for s, d in enumerate(devices):
        comp[s] = (tab.time if extra is None else tab.time + extra) / d.speed + tab.comm
        if s > 0:
            xfer[s] += 2 * _send_seconds(links[s - 1], cut)[:, None]
        if s < S - 1:
            xfer[s] += 2 * _send_seconds(links[s], cut)[None, :]
        mem[s] = tab.param + ks[s] * tab.act
    f = comp + xfer
    f[:, np.tril(np.ones((n + 1, n + 1), dtype=bool))] = np.inf     # j <= i: empty stage
    f[mem > np.array([d.memory for d in devices])[:, None, None]] = np.inf
    return comp, xfer, mem, f


def _send_seconds(links: tuple[Link, ...], nbytes: np.ndarray) -> np.ndarray:
    """Seconds to send ``nbytes`` over the slowest of ``links`` for that size (a stage pair whose
    rank pairs use different links moves at the pace of its slowest)."""
    return np.max([ln.alpha + ln.beta * nbytes for ln in links], axis=0)


def _pipeline_split(f: np.ndarray, m: int) -> Optional[tuple[float, list[int]]]:
    """The DP of the module docstring on stage times ``f``: (least step, its bounds), None
    when no split has finite times."""
    S, n = f.shape[0], f.shape[1] - 1
    tstar = _least_max(f)
    if not math.isfinite(tstar):
        return None
    limit = _best_bottleneck(f, tstar, m)
    G = np.full(n + 1, np.inf)
    G[n] = 0.0
    choice = np.zeros((S, n + 1), dtype=np.int64)
    for s in range(S - 1, -1, -1):
        g = np.where(f[s] <= limit, f[s] + G[None, :], np.inf)
        choice[s] = np.argmin(g, axis=1)             # first minimum: the smallest j
        G = g[np.arange(n + 1), choice[s]]
    bounds, i = [0], 0
    for s in range(S):
        i = int(choice[s][i])
        bounds.append(i)
    return float(G[0]) + (m - 1) * limit, bounds


def _least_max(t: np.ndarray) -> float:
    """The least ``max_s t[s, i_s, j_s]`` over splits (``H(0, 0)`` of the module docstring;
    inf entries are stages no split may use)."""
    S, n = t.shape[0], t.shape[1] - 1
    H = np.full(n + 1, np.inf)
    H[n] = 0.0
    for s in range(S - 1, -1, -1):
        H = np.min(np.maximum(t[s], H[None, :]), axis=1)
    return float(H[0])


def _split_with_tails(f: np.ndarray, m: int, tails: Sequence[np.ndarray]
                      ) -> Optional[list[int]]:
    """The bounds with the least ``pipeline step + sum_k max_s tails[k][s, i_s, j_s]`` (module
    docstring, "Tails"); None when no split has finite times."""
    base = _pipeline_split(f, m)
    if base is None or not tails:
        return None if base is None else base[1]
    S = f.shape[0]

    def total(bounds: list[int]) -> float:
        idx = (np.arange(S), bounds[:-1], bounds[1:])
        times = f[idx]
        return float(times.sum() + (m - 1) * times.max() + sum(t[idx].max() for t in tails))

    feasible = np.isfinite(f)
    p0, best_bounds = base
    best = total(best_bounds)
    low = [_least_max(np.where(feasible, t, np.inf)) for t in tails]
    values = [np.unique(t[feasible]) for t in tails]
    K = len(tails)

    def visit(k: int, allowed: np.ndarray, spent: float, floor: float) -> None:
        # floor: the least pipeline step under `allowed` (tails k.. unconstrained)
        nonlocal best, best_bounds
        if floor + spent + sum(low[k:]) >= best * (1 - STEP_RTOL):
            return
        if k == K:
            got = _pipeline_split(np.where(allowed, f, np.inf), m)
            if got is not None and total(got[1]) < best * (1 - STEP_RTOL):
                best, best_bounds = total(got[1]), got[1]
            return
        for a in values[k][values[k] >= low[k]]:
            a = float(a)
            if p0 + spent + a + sum(low[k + 1:]) >= best * (1 - STEP_RTOL):
                break                                  # every larger threshold costs more
            within = allowed & (tails[k] <= a)
            got = _pipeline_split(np.where(within, f, np.inf), m)
            if got is None:
                continue
            visit(k + 1, within, spent + a, got[0])
            if k == K - 1 and got[0] <= floor * (1 + STEP_RTOL):
                break                  # the pipeline is as short as it gets: raising a adds only

    visit(0, feasible, 0.0, p0)
    return best_bounds


def _solve(tab: _Tables, devices: Sequence[Device], order: tuple[int, ...],
           links: list[tuple[Link, ...]], ks: list[int], m: int,
           extra: Optional[np.ndarray] = None, tails: Sequence[np.ndarray] = ()
           ) -> Optional[Partition]:
    """The DP of the module docstring for one device order; None when nothing fits in memory."""
    comp, xfer, mem, f = _stage_times(tab, devices, links, ks, extra)
    bounds = _split_with_tails(f, m, tails)
    if bounds is None:
        return None
    idx = [(s, bounds[s], bounds[s + 1]) for s in range(len(devices))]
    return Partition(bounds=tuple(bounds), order=order, devices=tuple(devices),
                     compute=tuple(float(comp[t]) for t in idx),
                     transfer=tuple(float(xfer[t]) for t in idx),
                     times=tuple(float(f[t]) for t in idx),
                     memory=tuple(float(mem[t]) for t in idx), inflight=tuple(ks), microbatches=m)


def _infeasible(blocks: Sequence[Block], devices: Sequence[Device], ks_of: Callable[[int], int],
                any_order: bool) -> PartitionError:
    """Explain why nothing fits: a block too big for every device it could run on, or the total."""
    n, S = len(blocks), len(devices)
    for b, blk in enumerate(blocks):
        # Every stage is non-empty: block b sits on a stage in max(0, b - (n - S))..min(b, S - 1).
        pos = range(max(0, b - (n - S)), min(b, S - 1) + 1)
        cands = [(k, s) for s in pos for k in (range(S) if any_order else [s])]
        need = {(k, s): blk.param_bytes + ks_of(s) * blk.act_bytes for k, s in cands}
        if all(need[c] > devices[c[0]].memory for c in cands):
            k, s = min(cands, key=lambda c: (need[c] - devices[c[0]].memory, c))
            label = f"block {b}" + (f" ({blk.name!r})" if blk.name else "")
            return PartitionError(
                f"{label} alone needs {_fmt(need[(k, s)])} on stage {s} ({_fmt(blk.param_bytes)} "
                f"of parameters + {ks_of(s)} micro-batch(es) x {_fmt(blk.act_bytes)} of "
                f"activations) but {_dev(devices, k)} has {_fmt(devices[k].memory)}, the closest "
                f"fit among the devices it could run on"
                f"{' in any order' if any_order else ''}; give it a device with more memory, "
                f"fewer micro-batches in flight, or split the block")
    return PartitionError(
        f"no split of {n} blocks into {S} contiguous stages fits the devices' memory"
        f"{' in any order' if any_order else ''}: the blocks hold "
        f"{_fmt(sum(b.param_bytes for b in blocks))} of parameters and "
        f"{_fmt(sum(b.act_bytes for b in blocks))} of activations per micro-batch, in flight "
        f"{[ks_of(s) for s in range(S)]} per stage, and the devices have "
        f"{[_fmt(d.memory) for d in devices]}; use more stages, fewer micro-batches in flight, or "
        f"devices with more memory")


def partition_stages(blocks: Sequence[Block], devices: Sequence[Device],
                     link: LinkSpec = Link(), microbatches: int = 1,
                     inflight: InflightFn = inflight_1f1b,
                     extra: Optional[np.ndarray] = None,
                     tails: Sequence[np.ndarray] = ()) -> Partition:
    """The contiguous split of ``blocks`` over ``devices``, in their order, with the least
    pipeline step time, plus ``tails`` (exact; the module docstring has the model and the
    tie-breaks).

    link: one :class:`Link` for every stage pair, a list of ``S - 1`` (pair ``s`` joins stages
    ``s`` and ``s + 1``; an entry may be a list of Links, of which each message takes the
    slowest), or a function ``(Device, Device) -> Link``. microbatches: ``m``.
    inflight: ``(stage, stages, m) -> k_s``. extra: ``[B + 1, B + 1]`` seconds a stage over
    blocks ``[i, j)`` adds (module docstring). tails: ``[S, B + 1, B + 1]`` seconds, once per
    step, of stage ``s`` on blocks ``[i, j)`` (the gradient all-reduce, the optimizer update):
    the step adds each tail's largest stage (module docstring, "Tails"). Raises
    :class:`PartitionError` on invalid input or when no split fits in memory.
    """
    _check_inputs(blocks, devices, microbatches)
    m, S = int(microbatches), len(devices)
    ks = _inflight(inflight, S, m)
    shape = (S, len(blocks) + 1, len(blocks) + 1)
    tails = [np.asarray(t, dtype=np.float64) for t in tails]
    for k, t in enumerate(tails):
        if t.shape != shape or np.isnan(t).any() or (t < 0).any():
            raise PartitionError(f"tails[{k}] must be a {list(shape)} array of seconds >= 0 "
                                 f"(entry [s, i, j]: stage s on blocks i..j-1); got shape "
                                 f"{list(t.shape)}")
    p = _solve(_Tables(blocks), devices, tuple(range(S)), _links(link, devices), ks, m,
               None if extra is None else _extra(extra, len(blocks)), tails)
    if p is None:
        raise _infeasible(blocks, devices, lambda s: ks[s], any_order=False)
    return p


def _classes(items: Sequence[Any]) -> list[int]:
    """Each item's class: equal items share one, numbered by first appearance."""
    kinds: list[Any] = []
    for item in items:
        if item not in kinds:
            kinds.append(item)
    return [kinds.index(item) for item in items]


def order_count(items: Sequence[Any]) -> int:
    """How many distinct orders ``items`` has, equal items interchangeable: ``S! / prod n_c!``."""
    classes = _classes(items)
    count = math.factorial(len(items))
    for c in set(classes):
        count //= math.factorial(classes.count(c))
    return count


def distinct_orders(items: Sequence[Any]) -> Iterator[tuple[int, ...]]:
    """Every distinct order of ``items`` (equal items interchangeable) as indices into it, in
    lexicographic order of their classes (numbered by first appearance): the ``n``-th place of
    a class takes that class's ``n``-th item in input order."""
    classes = _classes(items)
    counts = [classes.count(c) for c in range(max(classes, default=-1) + 1)]
    members = [[k for k, c in enumerate(classes) if c == cls] for cls in range(len(counts))]
    perm: list[int] = []

    def rec() -> Iterator[tuple[int, ...]]:
        if len(perm) == len(classes):
            seen = [0] * len(counts)
            order = []
            for c in perm:
                order.append(members[c][seen[c]])
                seen[c] += 1
            yield tuple(order)
            return
        for c, left in enumerate(counts):
            if left:
                counts[c] -= 1
                perm.append(c)
                yield from rec()
                perm.pop()
                counts[c] += 1

    return rec()


def partition_stages_best_order(blocks: Sequence[Block], devices: Sequence[Device],
                                link: Union[Link, Callable[[Device, Device], Link]] = Link(),
                                microbatches: int = 1, inflight: InflightFn = inflight_1f1b,
                                max_orders: int = 5040,
                                extra: Optional[np.ndarray] = None) -> Partition:
    """The least-step-time split over every distinct order of ``devices`` (see the module).

    ``Partition.order[s]`` is the index in ``devices`` of the device that runs stage ``s``.
    ``link`` is one :class:`Link` or a function of the two devices (a per-pair list would be tied
    to one order). Raises :class:`PartitionError` when there are more than ``max_orders`` distinct
    orders or no order fits in memory.
    """
    _check_inputs(blocks, devices, microbatches)
    if not isinstance(link, Link) and not callable(link):
        raise PartitionError(f"link is a {type(link).__name__}; for a search over device orders "
                             f"pass one Link or a function (Device, Device) -> Link")
    m, S = int(microbatches), len(devices)
    ks = _inflight(inflight, S, m)
    count = order_count(devices)
    if count > max_orders:
        raise PartitionError(f"{S} devices in {len(set(_classes(devices)))} classes have {count} "
                             f"distinct orders, more than max_orders={max_orders}; group equal "
                             f"devices, fix the order with partition_stages, or raise max_orders")
    tab = _Tables(blocks)
    ex = None if extra is None else _extra(extra, len(blocks))
    found: list[Partition] = []
    for order in distinct_orders(devices):
        devs = [devices[k] for k in order]
        p = _solve(tab, devs, tuple(order), _links(link, devs), ks, m, ex)
        if p is not None:
            found.append(p)
    if not found:
        raise _infeasible(blocks, devices, lambda s: ks[s], any_order=True)
    # The tie-breaks of one order across orders: steps within STEP_RTOL of the least tie, then
    # the least bottleneck, then the first order.
    tie = min(p.step_time() for p in found) * (1 + STEP_RTOL)
    return min((p for p in found if p.step_time() <= tie), key=lambda p: p.bottleneck)
