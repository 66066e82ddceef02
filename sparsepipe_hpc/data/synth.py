"""Synthetic point clouds in both layouts: furnished rooms (segmentation) and single objects
(classification), seeded and fast enough to make on first use.

    python -m sparsepipe_hpc.data.synth --out data/ --task both --scenes 48 --seed 0
    # -> data/scenes/{train,val}.h5   (scene layout, 8 classes)
    #    data/modelnet/{train0,test0}.h5, shape_names.txt   (ModelNet40 layout, 6 classes)
    python -m sparsepipe_hpc.data.synth --out data/ --task floor --floor-points 20000000
    # -> data/floor/{train,val}.h5    (one floor of rooms each, chunked scene layout:
    #                                  sparsepipe_hpc.data.floor)

    from sparsepipe_hpc.data.synth import generate_scenes, generate_objects
    scenes_dir = generate_scenes("data", train=48, val=12, seed=0)

Rooms (about 4 m x 4 m x 2.5 m, origin at a floor corner, z up) hold a floor, up to four walls and
6-14 objects of the six shapes (box, sphere, cylinder, cone, torus, plane). Objects rest on the
floor, on top of a box, or (planes) lean against a wall; sizes, aspect ratios, rotation about z,
positions, counts and point densities vary per room and object, and every surface gets a random
colour, so colour says nothing about the class. Points are sampled on surfaces by area (hidden
bottoms and the floor under solid objects left out) with Gaussian noise, 20k-60k per room.

Objects for classification: one shape each, P points (default 1024) in random order, anisotropic
scaling, random rotation about z, noise, then centred and scaled into the unit sphere.

Every room and object draws from its own generator seeded by ``(seed, split, index)``: the same seed
gives the same arrays, and room 5 is the same room whether 10 or 100 are made.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from sparsepipe_hpc.data.modelnet import write_modelnet
from sparsepipe_hpc.data.scenes import write_scenes
from sparsepipe_hpc.data.shapes import SHAPES, area, extent, sample_surface

__all__ = ["GENERATOR_VERSION", "SEG_CLASSES", "CLS_CLASSES", "make_room", "make_object",
           "generate_scenes", "generate_objects", "main"]

#: Bump when the output changes for the same parameters (it keys the default-data cache).
GENERATOR_VERSION = 1
SEG_CLASSES = ("floor", "wall", "box", "sphere", "cylinder", "cone", "torus", "plane")
CLS_CLASSES = SHAPES
_SPLIT_CODE = {"train": 0, "val": 1, "test": 2}
_TASK_CODE = {"seg": 0, "cls": 1}


def _rng(seed: int, task: str, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _TASK_CODE[task], _SPLIT_CODE[split], index])


def _rotate_z(xy: np.ndarray, yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return xy @ np.array([[c, s], [-s, c]])  # row vectors: (x, y) -> (c x - s y, s x + c y)


def random_params(kind: str, rng: np.random.Generator) -> dict:
    """Random dimensions (metres) of a shape, with its aspect ratio varying as much as its size."""
    u = rng.uniform
    if kind == "box":
        return {"sx": u(0.3, 1.2), "sy": u(0.3, 1.2), "sz": u(0.2, 1.0)}
    if kind == "sphere":
        return {"r": u(0.12, 0.45)}
    if kind == "cylinder":
        return {"r": u(0.08, 0.35), "h": u(0.3, 1.2), "lying": bool(rng.random() < 0.3)}
    if kind == "cone":
        return {"r": u(0.12, 0.45), "h": u(0.3, 1.2)}
    if kind == "torus":
        big = u(0.2, 0.5)
        return {"R": big, "a": big * u(0.15, 0.45)}
    if kind == "plane":
        return {"w": u(0.4, 1.4), "l": u(0.5, 1.6), "tilt": math.pi / 2}
    raise ValueError(f"unknown shape {kind!r}")


# --- rooms ---------------------------------------------------------------------------------------
class _Placed:
    """An object in a room: shape, parameters, yaw about z and the position of its resting point."""

    def __init__(self, kind: str, p: dict, yaw: float, x: float, y: float, z: float) -> None:
        self.kind, self.p, self.yaw = kind, p, yaw
        self.pos = np.array([x, y, z], dtype=np.float64)
        ex, ey, self.height = extent(kind, p)
        self.radius = math.hypot(ex, ey)  # footprint circle, for overlap tests at any yaw
        self.carries = False              # a box with something on top already
        self.shelved = False              # a box covered by a board: its top face is hidden

    def to_world(self, local: np.ndarray) -> np.ndarray:
        out = np.empty_like(local)
        out[:, :2] = _rotate_z(local[:, :2], self.yaw) + self.pos[:2]
        out[:, 2] = local[:, 2] + self.pos[2]
        return out

    def covers(self, xy: np.ndarray) -> np.ndarray:
        """Which floor points ``xy [n, 2]`` lie under this object's solid base (hidden by it)."""
        local = _rotate_z(xy - self.pos[:2], -self.yaw)
        if self.kind == "box":
            return ((np.abs(local[:, 0]) < self.p["sx"] / 2)
                    & (np.abs(local[:, 1]) < self.p["sy"] / 2))
        if self.kind == "cone" or (self.kind == "cylinder" and not self.p["lying"]):
            return (local ** 2).sum(1) < self.p["r"] ** 2
        return np.zeros(len(xy), dtype=bool)


def _place_on_floor(rng: np.random.Generator, obj: _Placed, lx: float, ly: float,
                    placed: list[_Placed], tries: int = 30) -> bool:
    margin = 0.03
    lo, hix, hiy = obj.radius + margin, lx - obj.radius - margin, ly - obj.radius - margin
    if hix <= lo or hiy <= lo:
        return False
    for _ in range(tries):
        x, y = rng.uniform(lo, hix), rng.uniform(lo, hiy)
        if all(math.hypot(x - q.pos[0], y - q.pos[1]) > obj.radius + q.radius + margin
               for q in placed if q.pos[2] == 0.0):
            obj.pos[:] = (x, y, 0.0)
            return True
    return False


def _lean_on_wall(rng: np.random.Generator, obj: _Placed, lx: float, ly: float,
                  walls: list[int], placed: list[_Placed]) -> bool:
    """Put a plane with its bottom edge on the floor and its top edge touching a wall."""
    wall = walls[int(rng.integers(len(walls)))]
    half_depth = obj.p["l"] * math.cos(obj.p["tilt"]) / 2
    along = (lx, ly, lx, ly)[wall]
    if along < obj.p["w"] + 0.1:
        return False
    for _ in range(30):
        t = rng.uniform(obj.p["w"] / 2 + 0.05, along - obj.p["w"] / 2 - 0.05)
        # Local +y (the direction the top edge leans to) must point at the wall.
        x, y, yaw = ((t, half_depth, math.pi),            # wall y = 0
                     (lx - half_depth, t, -math.pi / 2),  # wall x = lx
                     (t, ly - half_depth, 0.0),           # wall y = ly
                     (half_depth, t, math.pi / 2))[wall]  # wall x = 0
        if all(math.hypot(x - q.pos[0], y - q.pos[1]) > obj.radius + q.radius + 0.03
               for q in placed if q.pos[2] == 0.0):
            obj.yaw = yaw
            obj.pos[:] = (x, y, 0.0)
            return True
    return False


def _stack_on_box(rng: np.random.Generator, obj: _Placed, placed: list[_Placed],
                  ceiling: float) -> bool:
    boxes = [q for q in placed if q.kind == "box" and q.pos[2] == 0.0 and not q.carries
             and obj.radius <= min(q.p["sx"], q.p["sy"]) / 2
             and q.height + obj.height < ceiling]
    if not boxes:
        return False
    base = boxes[int(rng.integers(len(boxes)))]
    slack = min(base.p["sx"], base.p["sy"]) / 2 - obj.radius
    off = rng.uniform(-slack, slack, 2) / math.sqrt(2)
    obj.pos[:] = (base.pos[0] + off[0], base.pos[1] + off[1], base.height)
    base.carries = True
    return True


def make_room(rng: np.random.Generator, size: Sequence[float] = (4.0, 4.0, 2.5),
              objects: tuple[int, int] = (6, 14), points: tuple[int, int] = (20_000, 60_000)
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One furnished room: ``(xyz float32 [P, 3] m, rgb uint8 [P, 3], label uint8 [P])`` with
    labels indexing :data:`SEG_CLASSES`. ``size`` is the mean (x, y, z) extent (each varies by
    +-10%), ``objects`` and ``points`` are inclusive ranges."""
    lx, ly, lz = (s * rng.uniform(0.9, 1.1) for s in size)
    walls = [w for w in range(4) if rng.random() > 0.15]
    if len(walls) < 2:
        walls = [0, 3]
    placed: list[_Placed] = []
    for _ in range(int(rng.integers(objects[0], objects[1] + 1))):
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        obj = _Placed(kind, random_params(kind, rng), rng.uniform(0, 2 * math.pi), 0, 0, 0)
        if kind == "plane":
            mode = rng.choice(["lean", "stand", "shelf"], p=[0.5, 0.25, 0.25])
            bases = [q for q in placed if q.kind == "box" and q.pos[2] == 0.0 and not q.carries]
            if mode == "shelf" and bases:  # a board lying on a box, overhanging a little
                base = bases[int(rng.integers(len(bases)))]
                obj = _Placed(kind, {"w": base.p["sx"] * rng.uniform(0.8, 1.3),
                                     "l": base.p["sy"] * rng.uniform(0.8, 1.3), "tilt": 0.0},
                              base.yaw, float(base.pos[0]), float(base.pos[1]),
                              base.height + 0.002)
                base.carries = base.shelved = True
                placed.append(obj)
                continue
            if mode != "stand":
                obj = _Placed(kind, {**obj.p, "tilt": rng.uniform(1.0, 1.45)}, 0, 0, 0, 0)
                if _lean_on_wall(rng, obj, lx, ly, walls, placed):
                    placed.append(obj)
                continue
        if rng.random() < 0.3 and _stack_on_box(rng, obj, placed, lz - 0.1):
            placed.append(obj)
        elif _place_on_floor(rng, obj, lx, ly, placed):
            placed.append(obj)

    # Share the points by area; objects are sampled denser (a scanner sees them from closer).
    wall_area = [(lx if w % 2 == 0 else ly) * lz for w in walls]
    weights = np.array([lx * ly] + wall_area
                       + [area(o.kind, o.p) * rng.uniform(2.0, 4.5) for o in placed])
    total = int(rng.integers(points[0], points[1] + 1))
    counts = np.round(weights / weights.sum() * total).astype(np.int64)
    counts[1 + len(walls):] = np.maximum(counts[1 + len(walls):], 150)
    counts[0] = max(counts[0] - max(int(counts.sum()) - total, 0), 1000)  # keep the total in range

    xyz, labels, rgb = [], [], []

    def add(pts: np.ndarray, label: int) -> None:
        xyz.append(pts)
        labels.append(np.full(len(pts), label, dtype=np.uint8))
        colour = rng.uniform(0, 255, 3)
        rgb.append(colour + rng.normal(0, 8, (len(pts), 3)))

    floor = np.zeros((0, 3))
    # Top up: the floor under solid objects is hidden. Their footprints fit in disjoint circles,
    # so they cover well under 100% of the floor and this ends after a round or two.
    while len(floor) < counts[0]:
        more = np.column_stack([rng.random(counts[0]) * lx, rng.random(counts[0]) * ly,
                                np.zeros(counts[0])])
        hidden = np.zeros(len(more), dtype=bool)
        for o in placed:
            if o.pos[2] == 0.0:
                hidden |= o.covers(more[:, :2])
        floor = np.concatenate([floor, more[~hidden]])
    add(floor[:counts[0]], 0)
    for w, n in zip(walls, counts[1:1 + len(walls)]):
        t, z = rng.random(n) * (lx if w % 2 == 0 else ly), rng.random(n) * lz
        fixed = np.full(n, (0.0, lx, ly, 0.0)[w])
        add(np.column_stack([t, fixed, z] if w % 2 == 0 else [fixed, t, z]), 1)
    for o, n in zip(placed, counts[1 + len(walls):]):
        local = sample_surface(o.kind, o.p, 2 * n, rng)  # in random order: keep the first n seen
        if o.kind in ("box", "cone") or (o.kind == "cylinder" and not o.p["lying"]):
            local = local[local[:, 2] > 1e-9]  # the bottom face rests on something: unseen
        if o.shelved:
            local = local[local[:, 2] < o.p["sz"] - 1e-9]
        add(o.to_world(local[:n]), 2 + SHAPES.index(o.kind))
    pts = np.concatenate(xyz)
    pts += rng.normal(0, rng.uniform(0.002, 0.008), pts.shape)
    colours = np.clip(np.concatenate(rgb), 0, 255).round().astype(np.uint8)
    return pts.astype(np.float32), colours, np.concatenate(labels)


# --- single objects ------------------------------------------------------------------------------
def make_object(rng: np.random.Generator, kind: str, n: int = 1024) -> np.ndarray:
    """``n`` points (float32 [n, 3], random order) on one shape: anisotropically scaled, rotated
    about z, noisy, centred on its mean and scaled so the farthest point has norm 1."""
    p = random_params(kind, rng)
    if kind == "plane":
        p["tilt"] = rng.uniform(0.0, math.pi / 2)
    if kind == "cylinder":
        p["lying"] = bool(rng.random() < 0.4)
    pts = sample_surface(kind, p, n, rng)
    pts -= pts.mean(0)
    pts *= rng.uniform(0.7, 1.4, 3)
    pts[:, :2] = _rotate_z(pts[:, :2], rng.uniform(0, 2 * math.pi))
    scale = np.linalg.norm(pts, axis=1).max()
    pts += rng.normal(0, rng.uniform(0.005, 0.02) * scale, pts.shape)
    pts -= pts.mean(0)
    pts /= np.linalg.norm(pts, axis=1).max()
    return pts.astype(np.float32)


# --- files ---------------------------------------------------------------------------------------
def generate_scenes(out: str | Path, train: int = 48, val: int = 12, seed: int = 0,
                    size: Sequence[float] = (4.0, 4.0, 2.5), objects: tuple[int, int] = (6, 14),
                    points: tuple[int, int] = (20_000, 60_000),
                    chunk_size: Optional[float] = None) -> Path:
    """Write ``out/scenes/train.h5`` and ``out/scenes/val.h5``; returns ``out/scenes``.
    ``chunk_size`` (metres): the chunked scene layout (:mod:`sparsepipe_hpc.data.chunks`)."""
    d = Path(out) / "scenes"
    d.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("val", val)):
        attrs = {"generator": "sparsepipe_hpc.data.synth", "generator_version": GENERATOR_VERSION,
                 "seed": seed, "split": split}
        rooms = ((f"room_{i:04d}", *make_room(_rng(seed, "seg", split, i), size, objects, points))
                 for i in range(count))
        write_scenes(d / f"{split}.h5", rooms, SEG_CLASSES, attrs, chunk_size=chunk_size)
    return d


def generate_objects(out: str | Path, train: int = 2048, test: int = 512, points: int = 1024,
                     seed: int = 0, per_file: int = 2048) -> Path:
    """Write ``out/modelnet/{train,test}<k>.h5`` (``per_file`` objects each) and
    ``shape_names.txt``; object ``i`` has class ``i % 6``. Returns ``out/modelnet``."""
    d = Path(out) / "modelnet"
    d.mkdir(parents=True, exist_ok=True)
    (d / "shape_names.txt").write_text("".join(f"{c}\n" for c in CLS_CLASSES))
    for split, count in (("train", train), ("test", test)):
        if count < 1:
            continue
        labels = np.arange(count) % len(CLS_CLASSES)
        data = np.stack([make_object(_rng(seed, "cls", split, i), CLS_CLASSES[labels[i]], points)
                         for i in range(count)])
        for k, start in enumerate(range(0, count, per_file)):
            write_modelnet(d / f"{split}{k}.h5", data[start:start + per_file],
                           labels[start:start + per_file], CLS_CLASSES)
    return d


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsepipe_hpc.data.synth", description=__doc__
                                 .split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--task", choices=["seg", "cls", "both", "floor"], default="both",
                    help="floor: one large scene per split (a floor of rooms, chunked layout)")
    ap.add_argument("--floor-points", type=int, default=4_000_000, help="points per floor")
    ap.add_argument("--floor-rooms", type=int, nargs=2, default=(2, 2), metavar=("X", "Y"),
                    help="rooms of the floor along x and y")
    ap.add_argument("--chunk-size", type=float, default=0.5,
                    help="metres per chunk of the floor's chunked layout; 0: unchunked")
    ap.add_argument("--scenes", type=int, default=48, help="training rooms (seg)")
    ap.add_argument("--val-scenes", type=int, default=None, help="validation rooms (default "
                    "scenes/4, at least 1)")
    ap.add_argument("--room", type=float, nargs=3, default=(4.0, 4.0, 2.5), metavar=("X", "Y", "Z"),
                    help="mean room size in metres")
    ap.add_argument("--room-points", type=int, nargs=2, default=(20_000, 60_000),
                    metavar=("MIN", "MAX"), help="points per room")
    ap.add_argument("--objects", type=int, default=2048, help="training objects (cls)")
    ap.add_argument("--test-objects", type=int, default=None, help="test objects (default "
                    "objects/4, at least 1)")
    ap.add_argument("--points", type=int, default=1024, help="points per object (cls)")
    ap.add_argument("--per-file", type=int, default=2048, help="objects per ModelNet file")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for name in ("scenes", "objects", "points", "per_file"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(a, name)}")
    if not 1 <= a.room_points[0] <= a.room_points[1]:
        ap.error(f"--room-points needs 1 <= MIN <= MAX; got {a.room_points}")
    t0 = time.perf_counter()
    if a.task == "floor":
        from sparsepipe_hpc.data.floor import generate_floor

        if a.floor_points < 1 or min(a.floor_rooms) < 1 or a.chunk_size < 0:
            ap.error("--floor-points and --floor-rooms must be >= 1 and --chunk-size >= 0; got "
                     f"{a.floor_points}, {a.floor_rooms}, {a.chunk_size}")
        d = generate_floor(a.out, a.floor_points, a.seed, a.floor_rooms[0], a.floor_rooms[1],
                           chunk_size=a.chunk_size or None)
        print(f"wrote 2 floors of {a.floor_points} points to {d}/{{train,val}}.h5")
    if a.task in ("seg", "both"):
        val = a.val_scenes if a.val_scenes is not None else max(1, a.scenes // 4)
        d = generate_scenes(a.out, a.scenes, val, a.seed, a.room, points=tuple(a.room_points))
        print(f"wrote {a.scenes} + {val} rooms to {d}/{{train,val}}.h5")
    if a.task in ("cls", "both"):
        test = a.test_objects if a.test_objects is not None else max(1, a.objects // 4)
        d = generate_objects(a.out, a.objects, test, a.points, a.seed, a.per_file)
        print(f"wrote {a.objects} + {test} objects of {a.points} points to {d}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
