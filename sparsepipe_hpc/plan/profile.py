"""Per-block profile of a model: time, activation, transfer and parameter bytes vs voxel count.

    from sparsepipe_hpc.nn import build_model
    from sparsepipe_hpc.plan.profile import profile_model, synthetic_batch, ModelProfile
    net = build_model("unet", 3, 8, width=16, depth=3)
    batches = [synthetic_batch(v, 3, multiple=net.total_stride) for v in (4000, 8000, 16000)]
    prof = profile_model(net, batches, repeats=5, name="unet")
    prof.blocks[1].time(20000)                 # seconds fwd + bwd of block 1 on 20k input voxels
    ModelProfile.from_json(prof.to_json())     # round trip (== prof)

What is measured, for every batch and every block ``b`` of a block sequence (one carry in, one
carry out; :mod:`sparsepipe_hpc.nn.models`), on the device the batch lives on:

* the model runs as if cut after *every* block: each block gets detached copies of its carry
  (kernel maps still shared, so a decoder reuses its encoder's maps as in one process) and the
  backward runs block by block in reverse with the gradients the next block produced. Forward and
  backward of each block are timed separately, ``torch.cuda.synchronize()`` around each on CUDA;
  each timing is the median of ``repeats`` runs after ``warmup`` runs, every run from fresh
  kernel maps (a training step builds them once per step too). Seconds.
* ``act_bytes``: bytes of the tensors autograd saves for the block's backward (a saved-tensor
  hook, parameters excluded, each storage counted once): what a pipeline keeps per micro-batch.
* ``out_bytes``: bytes of the whole carry after the block (coordinates int32 + features), i.e.
  everything that crosses a cut placed there, U-Net skips passing through included
  (:mod:`sparsepipe_hpc.pipeline.carry` sends each once).
* ``param_bytes``: bytes of the block's parameters (weights only; the cost model multiplies by the
  optimizer's state factor).
* halo: for every submanifold convolution (kernel radius ``r`` > 0, ``C`` input channels, ``V_l``
  input voxels on a grid of ``E_l`` voxels per axis at its stride), the coefficient
  ``halo[a] = sum_l r * C * itemsize * (V_l / E_l[a]) / (V / E[a])`` in bytes, with ``V``, ``E``
  the model input's voxels and extent: a rank with ``g`` boxes sees ``V / E[a]`` input voxels per
  voxel layer across axis ``a``, so the cost model gets halo bytes from it for any grid
  (:func:`sparsepipe_hpc.plan.cost.halo_bytes`). ``exchanges``: how many such convolutions.
* ``update``, ``update_sgd``: seconds of one AdamW step and of one SGD step (momentum and weight
  decay, as the trainer's ``--optimizer sgd``) over the block's parameters (once per training
  step, whatever the voxels; the parameters and gradients are restored afterwards).
  :meth:`BlockProfile.update_for` picks one; a profile without ``update_sgd`` (written before
  it was measured) gives SGD the AdamW time, the larger.
* kernel maps (:class:`KmapProfile`): which block makes each map and which blocks reuse it, and
  the seconds to build it; a pipeline stage rebuilds the maps made before it
  (:meth:`ModelProfile.rebuild_costs`, added to its stages by the search).
* ``split`` (:class:`~sparsepipe_hpc.plan.split.SplitFit`): the seconds a spatial split adds
  to the block (halo plans, the halo parts of its maps, halo-pair compute), measured by
  playing the busiest box of a few grids (:func:`~sparsepipe_hpc.plan.split.split_probe`) and
  fitted in box voxels and surface voxels.
* ``peak_bytes`` of the whole run (CUDA only; ``None`` on CPU, where torch keeps no peak).

Time and bytes are fitted per block as ``a + b * voxels`` by least squares over the batches
(``voxels`` = the batch's input voxels, all samples together), so one profile predicts other
sample sizes, micro-batch sizes and box sizes (a box's share of the voxels). With one batch size
the fit is proportional (``a = 0``). Predictions are clamped at 0.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from sparsepipe_hpc.plan.probes import clock, halo_probe, kmap_probe, synthetic_batch
from sparsepipe_hpc.plan.split import PROBE_GRIDS, SplitFit, fit_split, split_probe
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["Fit", "BlockProfile", "KmapProfile", "ModelProfile", "ProfileError", "profile_model",
           "synthetic_batch", "fit_linear"]


class ProfileError(ValueError):
    """A profile that cannot be made or read (bad batches, bad JSON)."""


@dataclass(frozen=True)
class Fit:
    """``value(v) = max(0, a + b * v)`` for ``v`` voxels."""

    a: float
    b: float

    def __call__(self, voxels: float) -> float:
        return max(0.0, self.a + self.b * float(voxels))


def fit_linear(voxels: Sequence[float], values: Sequence[float]) -> Fit:
    """Least-squares ``a + b * v``; proportional (``a = 0``) when all ``v`` are equal."""
    v = np.asarray(voxels, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    if len(v) == 0 or len(v) != len(y):
        raise ProfileError(f"fit_linear needs equal, non-empty voxel and value lists; got "
                           f"{len(v)} and {len(y)}")
    if np.ptp(v) == 0:
        return Fit(0.0, float(y.mean() / v[0]) if v[0] > 0 else 0.0)
    b, a = np.polyfit(v, y, 1)
    return Fit(float(a), float(b))


@dataclass(frozen=True)
class BlockProfile:
    """One block's fits (seconds and bytes as functions of the model's input voxels)."""

    name: str
    forward: Fit
    backward: Fit
    act_bytes: Fit
    out_bytes: Fit
    param_bytes: float
    halo: tuple[float, float, float] = (0.0, 0.0, 0.0)
    exchanges: int = 0
    measured: tuple[dict[str, float], ...] = ()
    update: float = 0.0
    split: SplitFit = SplitFit()
    update_sgd: Optional[float] = None

    def time(self, voxels: float) -> float:
        """Seconds forward + backward on ``voxels`` input voxels (reference device)."""
        return self.forward(voxels) + self.backward(voxels)

    def update_for(self, optimizer: str) -> float:
        """Seconds of one step of ``optimizer`` (``"adamw"`` or ``"sgd"``) over the block."""
        if optimizer == "sgd" and self.update_sgd is not None:
            return self.update_sgd
        return self.update


@dataclass(frozen=True)
class KmapProfile:
    """A kernel map: made by block ``creator``, used by blocks ``users``; ``build``: seconds to
    build it, fitted in the model's input voxels. A pipeline stage that uses it but starts after
    ``creator`` rebuilds it from the coordinates it receives, once per micro-batch."""

    key: str
    creator: int
    users: tuple[int, ...]
    build: Fit


@dataclass(frozen=True)
class ModelProfile:
    """A model's per-block profile and what it was measured on.

    voxels_per_sample: mean input voxels per sample of the profiled batches; extent: the input
    grid in voxels (x, y, z); total_stride: the model's down-sampling (cuts align to it).
    """

    name: str
    device: str
    blocks: tuple[BlockProfile, ...]
    voxels_per_sample: float
    extent: tuple[int, int, int]
    total_stride: int
    in_channels: int
    sizes: tuple[int, ...] = ()
    peak_bytes: tuple[Optional[int], ...] = ()
    notes: dict[str, Any] = field(default_factory=dict)
    kmaps: tuple[KmapProfile, ...] = ()

    def __post_init__(self) -> None:
        _check_profile(self)

    def rebuild_costs(self, voxels: float) -> np.ndarray:
        """``[B + 1, B + 1]`` seconds: entry ``[i, j]`` is what a stage over blocks ``[i, j)``
        spends rebuilding kernel maps made before block ``i`` (each once), on ``voxels``."""
        n = len(self.blocks)
        out = np.zeros((n + 1, n + 1))
        for km in self.kmaps:
            cost = km.build(voxels)
            for i in range(km.creator + 1, n):
                first = min((u for u in km.users if u >= i), default=None)
                if first is not None:
                    out[i, first + 1:] += cost
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ModelProfile":
        try:
            d = json.loads(text)
            blocks = tuple(BlockProfile(
                name=b["name"], forward=Fit(**b["forward"]), backward=Fit(**b["backward"]),
                act_bytes=Fit(**b["act_bytes"]), out_bytes=Fit(**b["out_bytes"]),
                param_bytes=float(b["param_bytes"]), halo=tuple(b["halo"]),  # type: ignore
                exchanges=int(b["exchanges"]), measured=tuple(b["measured"]),
                update=float(b.get("update", 0.0)), split=SplitFit(**b.get("split", {})),
                update_sgd=None if b.get("update_sgd") is None else float(b["update_sgd"]))
                for b in d["blocks"])
            return cls(name=d["name"], device=d["device"], blocks=blocks,
                       voxels_per_sample=float(d["voxels_per_sample"]),
                       extent=tuple(d["extent"]),  # type: ignore[arg-type]
                       total_stride=int(d["total_stride"]), in_channels=int(d["in_channels"]),
                       sizes=tuple(d["sizes"]), peak_bytes=tuple(d["peak_bytes"]),
                       notes=dict(d.get("notes", {})),
                       kmaps=tuple(KmapProfile(k["key"], int(k["creator"]),
                                               tuple(k["users"]), Fit(**k["build"]))
                                   for k in d.get("kmaps", [])))
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"not a model profile ({type(e).__name__}: {e}); write one with "
                               f"ModelProfile.to_json or python -m sparsepipe_hpc.plan "
                               f"--profile-out FILE") from None


def _check_profile(p: ModelProfile) -> None:
    """Every figure a plan rests on is a finite number in its range (ProfileError naming it): a
    NaN time would read as 0 s through ``max(0, nan)``, a zero stride divides by zero."""
    def bad(field: str, value: Any, rule: str) -> ProfileError:
        return ProfileError(f"profile {p.name!r}: {field} is {value!r}; it must be {rule}")

    def number(field: str, value: Any, low: float = -math.inf, above: bool = False) -> None:
        ok = isinstance(value, (int, float, np.number)) and not isinstance(value, bool) \
            and math.isfinite(value) and (value > low if above else value >= low)
        if not ok:
            raise bad(field, value, "a finite number" + (f" {'>' if above else '>='} {low:g}"
                                                          if low > -math.inf else ""))

    def whole(field: str, value: Any, low: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise bad(field, value, f"a whole number >= {low}")

    number("voxels_per_sample", p.voxels_per_sample, 0.0, above=True)
    if len(p.extent) != 3:
        raise bad("extent", p.extent, "three whole numbers >= 1 (x, y, z voxels)")
    for a, e in enumerate(p.extent):
        whole(f"extent[{a}]", e, 1)
    whole("total_stride", p.total_stride, 1)
    whole("in_channels", p.in_channels, 1)
    for b, blk in enumerate(p.blocks):
        at = f"blocks[{b}] ({blk.name!r})"
        for name in ("forward", "backward", "act_bytes", "out_bytes"):
            fit = getattr(blk, name)
            number(f"{at}.{name}.a", fit.a)
            number(f"{at}.{name}.b", fit.b)
        for name in ("c", "a", "b"):
            number(f"{at}.split.{name}", getattr(blk.split, name))
        number(f"{at}.param_bytes", blk.param_bytes, 0.0)
        number(f"{at}.update", blk.update, 0.0)
        if blk.update_sgd is not None:
            number(f"{at}.update_sgd", blk.update_sgd, 0.0)
        if len(blk.halo) != 3:
            raise bad(f"{at}.halo", blk.halo, "three numbers >= 0 (bytes per voxel layer)")
        for a, h in enumerate(blk.halo):
            number(f"{at}.halo[{a}]", h, 0.0)
        whole(f"{at}.exchanges", blk.exchanges, 0)
    for k, km in enumerate(p.kmaps):
        number(f"kmaps[{k}].build.a", km.build.a)
        number(f"kmaps[{k}].build.b", km.build.b)
        for u in (km.creator, *km.users):
            if not 0 <= u < len(p.blocks):
                raise bad(f"kmaps[{k}] ({km.key!r}) block", u,
                          f"a block index in 0..{len(p.blocks) - 1}")


def _tensor(e: Any) -> Optional[torch.Tensor]:
    t = e.feats if isinstance(e, SparseTensor) else e
    return t if isinstance(t, torch.Tensor) and t.is_floating_point() else None


def _nbytes(e: Any) -> int:
    if isinstance(e, SparseTensor):
        return e.coords.numel() * e.coords.element_size() + e.feats.numel() * e.feats.element_size()
    return e.numel() * e.element_size() if isinstance(e, torch.Tensor) else 0


def _leaf(e: Any) -> Any:
    if isinstance(e, SparseTensor):
        return e.replace(feats=e.feats.detach().requires_grad_(True))
    if isinstance(e, torch.Tensor) and e.is_floating_point():
        return e.detach().requires_grad_(True)
    return e


def _sum_grads(t: Optional[torch.Tensor], through: Optional[torch.Tensor]
               ) -> Optional[torch.Tensor]:
    """An input's gradient: what backward gave it plus what it got as an untouched output."""
    if t is None:
        return None
    if t.grad is None:
        return through
    return t.grad if through is None else t.grad + through


def _run_once(blocks: Sequence[Any], x: SparseTensor, params: set[int],
              hooks: Optional[list[Any]] = None) -> dict[str, list[float]]:
    """One forward + backward, cut after every block; per-block seconds and bytes."""
    now = clock(x.feats.device)
    carry: list[Any] = [x.replace(kmaps={})]
    ins, outs = [], []
    fwd, act, out_b = [], [], []
    for blk in blocks:
        leaves = [_leaf(e) for e in carry]
        seen: set[int] = set()
        saved = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
            if ptr and ptr not in params and ptr not in seen:
                seen.add(ptr)
                saved[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            t0 = now()
            carry = blk(leaves)
            fwd.append(now() - t0)
        act.append(float(saved[0]))
        out_b.append(float(sum(_nbytes(e) for e in carry)))
        ins.append(leaves)
        outs.append(carry)
    bwd = [0.0] * len(blocks)
    last = [_tensor(e) for e in carry]
    grads: list[Optional[torch.Tensor]] = [None if t is None else torch.ones_like(t) for t in last]
    for k in range(len(blocks) - 1, -1, -1):
        tensors, gs = [], []
        for e, g in zip(outs[k], grads):
            t = _tensor(e)
            if t is not None and g is not None and t.grad_fn is not None:
                tensors.append(t)
                gs.append(g)
        t0 = now()
        if tensors:
            torch.autograd.backward(tensors, gs)
        bwd[k] = now() - t0
        passed = {id(e): g for e, g in zip(outs[k], grads)}   # entries the block left untouched
        grads = [_sum_grads(_tensor(e), passed.get(id(e))) for e in ins[k]]
    return {"forward": fwd, "backward": bwd, "act_bytes": act, "out_bytes": out_b}


def _update_time(block: Any, repeats: int, now: Callable[[], float],
                 optimizer: str = "adamw") -> float:
    """Median seconds of an AdamW or SGD step over ``block``'s parameters (restored
    afterwards); SGD with momentum and weight decay, as the trainer's."""
    params = [p for p in block.parameters() if p.requires_grad]
    if not params:
        return 0.0
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = (torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=1e-4)
           if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-3))
    times = []
    for _ in range(repeats + 1):
        t0 = now()
        opt.step()
        times.append(now() - t0)
    with torch.no_grad():
        for p, w, g in zip(params, saved, grads):
            p.copy_(w)
            p.grad = g
    return statistics.median(times[1:])


def profile_model(model: Any, batches: Sequence[SparseTensor], repeats: int = 5,
                  warmup: int = 1, name: str = "",
                  split_grids: Sequence[Sequence[int]] = PROBE_GRIDS,
                  autocast: Optional[torch.dtype] = None) -> ModelProfile:
    """Profile every block of ``model`` (a BlockSequence) on each batch; see the module.

    batches: input SparseTensors on the device to profile (2-3 sizes for a voxel fit).
    autocast: the low dtype a mixed-precision run computes in (``torch.float16``,
    ``torch.bfloat16``): every run, probe included, is under ``torch.autocast``, so times and
    bytes are that run's (``notes["autocast"]`` names it). None: float32.
    split_grids: grids whose busiest box the split probe plays (those with a box narrower
    than the model's total stride are skipped; none: no split cost).
    Leaves the model's train/eval mode and parameters as they were (gradients are cleared).
    """
    if not batches:
        raise ProfileError("batches is empty; pass 2-3 sample batches of different sizes")
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"repeats must be >= 1 and warmup >= 0; got {repeats}, {warmup}")
    if autocast not in (None, torch.float16, torch.bfloat16):
        raise ProfileError(f"autocast must be None, torch.float16 or torch.bfloat16; "
                           f"got {autocast}")
    blocks = list(model.blocks)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    was_training = model.training
    model.train()
    raw: list[list[dict[str, float]]] = [[] for _ in blocks]
    halo = [[0.0, 0.0, 0.0] for _ in blocks]
    exchanges = [0] * len(blocks)
    peaks: list[Optional[int]] = []
    kraw: list[dict[str, tuple[int, set[int], float]]] = []
    split_rows = []
    stride = int(getattr(model, "total_stride", 1))
    try:
        for bi, x in enumerate(batches):
            dev = x.feats.device
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            runs = []
            with torch.autocast(dev.type, dtype=autocast, enabled=autocast is not None):
                for r in range(warmup + repeats):
                    res = _run_once(blocks, x, params)
                    model.zero_grad(set_to_none=True)
                    if r >= warmup:
                        runs.append(res)
                peaks.append(int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda"
                             else None)
                coef, count = halo_probe(blocks, x)
                kraw.append(kmap_probe(blocks, x, repeats))
                grids = [g for g in split_grids if all(int(ga) <= max(1, e // stride)
                                                       for ga, e in zip(g, x.spatial_shape))]
                split_rows += split_probe(blocks, x, grids, repeats, align=stride)
            for k in range(len(blocks)):
                raw[k].append({"voxels": float(x.num_voxels),
                               **{key: statistics.median(run[key][k] for run in runs)
                                  for key in ("forward", "backward", "act_bytes", "out_bytes")}})
                halo[k] = [h + c / len(batches) for h, c in zip(halo[k], coef[k])]
                exchanges[k] = count[k]
    finally:
        model.train(was_training)
    now = clock(batches[0].feats.device)
    splits = fit_split(split_rows, len(blocks))
    profs = []
    for k, blk in enumerate(blocks):
        v = [m["voxels"] for m in raw[k]]
        fits = {key: fit_linear(v, [m[key] for m in raw[k]])
                for key in ("forward", "backward", "act_bytes", "out_bytes")}
        pbytes = float(sum(p.numel() * p.element_size() for p in blk.parameters()))
        profs.append(BlockProfile(name=f"{k}:{type(blk).__name__}", param_bytes=pbytes,
                                  halo=tuple(halo[k]), exchanges=exchanges[k],  # type: ignore
                                  measured=tuple(raw[k]),
                                  update=_update_time(blk, repeats, now), split=splits[k],
                                  update_sgd=_update_time(blk, repeats, now, "sgd"), **fits))
    kmaps = []
    for key, (creator, users, _) in kraw[0].items():
        fit = fit_linear([b.num_voxels for b in batches], [kr[key][2] for kr in kraw])
        kmaps.append(KmapProfile(key, creator, tuple(sorted(users)), fit))
    x0 = batches[0]
    vps = statistics.mean(b.num_voxels / b.batch_size for b in batches)
    return ModelProfile(name=name or type(model).__name__, device=str(x0.feats.device),
                        blocks=tuple(profs), voxels_per_sample=float(vps),
                        extent=tuple(x0.spatial_shape),  # type: ignore[arg-type]
                        total_stride=stride,
                        in_channels=x0.num_channels, sizes=tuple(b.num_voxels for b in batches),
                        peak_bytes=tuple(peaks),
                        notes={"repeats": repeats, "warmup": warmup,
                               "torch": torch.__version__,
                               "autocast": str(autocast).replace("torch.", "") if autocast
                               else None}, kmaps=tuple(kmaps))
