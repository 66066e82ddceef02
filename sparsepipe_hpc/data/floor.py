"""A building floor of furnished rooms as one large scene: the input for spatially parallel runs
(tens of millions of points), written in the chunked scene layout by default.

    write_floor("floor.h5", points=20_000_000, rooms_x=4, rooms_y=3, chunk_size=0.5)
    ds = SceneDataset("floor.h5")            # one scene 'floor'; ds.chunk_table(0): its chunks
    python -m sparsepipe_hpc.data.synth --out data/ --task floor --floor-points 20000000

Rooms come from :func:`sparsepipe_hpc.data.synth.make_room` (about 4 x 4 x 2.5 m, 0.5 m apart,
``rooms_x x rooms_y`` of them), ``points`` in all. With ``chunk_size`` (metres) the points are
stored sorted by spatial chunk with a chunk table (:mod:`sparsepipe_hpc.data.chunks`), so that a
rank of a spatial grid reads only the chunks near its box; ``chunk_size=None`` writes the plain
point-range layout. Memory while writing: about 60 bytes a point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["CHUNK_SIZE", "generate_floor", "make_floor", "write_floor"]

#: Default chunk edge (metres): a few thousand points per chunk at S3DIS-like densities.
CHUNK_SIZE = 0.5


def make_floor(rng: np.random.Generator, points: int, rooms_x: int = 2, rooms_y: int = 2
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(xyz float32 [P, 3] m, rgb uint8 [P, 3], label uint8 [P])``: rooms in row-major order
    (room (i, j) at x = 4.5 i, y = 4.5 j metres), P at most ``points`` (a room rounds its
    surfaces' shares of its points down, so P may fall short by a few per room)."""
    from sparsepipe_hpc.data.synth import make_room

    if rooms_x < 1 or rooms_y < 1:
        raise ValueError(f"a floor needs >= 1 room along x and y; got {rooms_x} x {rooms_y}")
    rooms = rooms_x * rooms_y
    if points < rooms:
        raise ValueError(f"{points} points cannot fill {rooms} rooms; pass >= 1 point per room")
    per = points // rooms
    xyz, rgb, lab = [], [], []
    for i in range(rooms_x):
        for j in range(rooms_y):
            n = per if (i, j) != (rooms_x - 1, rooms_y - 1) else points - per * (rooms - 1)
            p, c, l = make_room(rng, size=(4.0, 4.0, 2.5), points=(n, n))
            if len(p) > n:  # small rooms get a minimum of points per object: thin them to n
                keep = np.sort(rng.choice(len(p), n, replace=False))
                p, c, l = p[keep], c[keep], l[keep]
            xyz.append(p + np.array([4.5 * i, 4.5 * j, 0.0], np.float32))
            rgb.append(c)
            lab.append(l)
    return np.concatenate(xyz), np.concatenate(rgb), np.concatenate(lab)


def write_floor(path: str | Path, points: int, seed: int = 0, rooms_x: int = 2, rooms_y: int = 2,
                chunk_size: Optional[float] = CHUNK_SIZE) -> Path:
    """Write one floor (:func:`make_floor`) as the scene ``floor`` of a scene file; returns
    ``path``. ``chunk_size``: metres per chunk of the chunked layout; None: unchunked."""
    from sparsepipe_hpc.data.scenes import write_scenes
    from sparsepipe_hpc.data.synth import SEG_CLASSES

    xyz, rgb, lab = make_floor(np.random.default_rng(seed), points, rooms_x, rooms_y)
    return write_scenes(path, [("floor", xyz, rgb, lab)], class_names=SEG_CLASSES,
                        attrs={"generator": "sparsepipe_hpc.data.floor", "seed": seed,
                               "rooms": [rooms_x, rooms_y]},
                        chunk_size=chunk_size)


def generate_floor(out: str | Path, points: int, seed: int = 0, rooms_x: int = 2,
                   rooms_y: int = 2, chunk_size: Optional[float] = CHUNK_SIZE) -> Path:
    """Write ``out/floor/train.h5`` and ``out/floor/val.h5`` (one floor each, seeds ``seed`` and
    ``seed + 1``) for the trainer's ``--data``; returns ``out/floor``."""
    d = Path(out) / "floor"
    d.mkdir(parents=True, exist_ok=True)
    for split, s in (("train", seed), ("val", seed + 1)):
        write_floor(d / f"{split}.h5", points, s, rooms_x, rooms_y, chunk_size)
    return d
