"""Surface samplers for the synthetic shapes: box, sphere, cylinder, cone, torus, plane.

    rng = np.random.default_rng(0)
    pts = sample_surface("cone", {"r": 0.3, "h": 0.8}, 2000, rng)   # float64 [2000, 3]
    area("cone", {"r": 0.3, "h": 0.8})                              # m^2, to share points by area

Every shape is sampled uniformly by area (the torus by rejection) in a resting frame: centred on the
z axis, lowest point on z = 0, so that placing it on a floor or a box top is a translation. Units
are metres. Parameters per shape:

    box       sx, sy, sz           edge lengths
    sphere    r                    radius
    cylinder  r, h, lying (bool)   radius, length; lying: axis along x instead of z
    cone      r, h                 base radius, height (apex up)
    torus     R, a                 major and minor radius, lying flat
    plane     w, l, tilt           a w x l rectangle hinged on its bottom edge (along x) and tilted
                                   up from the floor by ``tilt`` radians (0 flat, pi/2 upright)
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

__all__ = ["SHAPES", "area", "sample_surface", "extent"]

SHAPES = ("box", "sphere", "cylinder", "cone", "torus", "plane")


def area(kind: str, p: dict) -> float:
    """Surface area in m^2."""
    if kind == "box":
        return 2.0 * (p["sx"] * p["sy"] + p["sx"] * p["sz"] + p["sy"] * p["sz"])
    if kind == "sphere":
        return 4.0 * math.pi * p["r"] ** 2
    if kind == "cylinder":
        return 2.0 * math.pi * p["r"] * (p["h"] + p["r"])
    if kind == "cone":
        return math.pi * p["r"] * (p["r"] + math.hypot(p["r"], p["h"]))
    if kind == "torus":
        return 4.0 * math.pi ** 2 * p["R"] * p["a"]
    if kind == "plane":
        return p["w"] * p["l"]
    raise ValueError(f"unknown shape {kind!r}; expected one of {SHAPES}")


def extent(kind: str, p: dict) -> tuple[float, float, float]:
    """Half-widths in x and y and height (m) of the shape's bounding box in its resting frame."""
    if kind == "box":
        return p["sx"] / 2, p["sy"] / 2, p["sz"]
    if kind == "sphere":
        return p["r"], p["r"], 2 * p["r"]
    if kind == "cylinder":
        if p.get("lying"):
            return p["h"] / 2, p["r"], 2 * p["r"]
        return p["r"], p["r"], p["h"]
    if kind == "cone":
        return p["r"], p["r"], p["h"]
    if kind == "torus":
        return p["R"] + p["a"], p["R"] + p["a"], 2 * p["a"]
    if kind == "plane":
        return p["w"] / 2, p["l"] * abs(math.cos(p["tilt"])) / 2, p["l"] * math.sin(p["tilt"])
    raise ValueError(f"unknown shape {kind!r}; expected one of {SHAPES}")


def _disc(n: int, r: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    rad = r * np.sqrt(rng.random(n))  # sqrt: uniform by area, not by radius
    phi = rng.random(n) * (2 * math.pi)
    return rad * np.cos(phi), rad * np.sin(phi)


def _box(n: int, p: dict, rng: np.random.Generator) -> np.ndarray:
    size = np.array([p["sx"], p["sy"], p["sz"]])
    faces = np.array([size[1] * size[2], size[0] * size[2], size[0] * size[1]])
    axis = rng.choice(3, n, p=faces / faces.sum())
    pts = (rng.random((n, 3)) - 0.5) * size
    side = rng.integers(0, 2, n) - 0.5  # each axis has two opposite faces of equal area
    pts[np.arange(n), axis] = side * size[axis]
    pts[:, 2] += size[2] / 2
    return pts


def _sphere(n: int, p: dict, rng: np.random.Generator) -> np.ndarray:
    v = rng.standard_normal((n, 3))
    v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return v * p["r"] + [0.0, 0.0, p["r"]]


def _cylinder(n: int, p: dict, rng: np.random.Generator) -> np.ndarray:
    r, h = p["r"], p["h"]
    on_side = rng.random(n) < h / (h + r)  # lateral 2*pi*r*h against caps 2*pi*r^2
    phi = rng.random(n) * (2 * math.pi)
    cx, cy = _disc(n, r, rng)
    x = np.where(on_side, r * np.cos(phi), cx)
    y = np.where(on_side, r * np.sin(phi), cy)
    z = np.where(on_side, rng.random(n) * h, h * rng.integers(0, 2, n))
    if p.get("lying"):
        return np.stack([z - h / 2, y, x + r], 1)
    return np.stack([x, y, z], 1)


def _cone(n: int, p: dict, rng: np.random.Generator) -> np.ndarray:
    r, h = p["r"], p["h"]
    slant = math.hypot(r, h)
    on_side = rng.random(n) < slant / (slant + r)  # pi*r*slant against pi*r^2
    t = np.sqrt(rng.random(n))  # distance from the apex, uniform by area on the mantle
    phi = rng.random(n) * (2 * math.pi)
    bx, by = _disc(n, r, rng)
    x = np.where(on_side, r * t * np.cos(phi), bx)
    y = np.where(on_side, r * t * np.sin(phi), by)
    z = np.where(on_side, h * (1 - t), 0.0)
    return np.stack([x, y, z], 1)


def _torus(n: int, p: dict, rng: np.random.Generator) -> np.ndarray:
    big, a = p["R"], p["a"]
    thetas = []
    have = 0
    while have < n:  # rejection: the area element grows with the distance R + a*cos(theta)
        th = rng.random(2 * n) * (2 * math.pi)
        keep = th[rng.random(2 * n) * (big + a) < big + a * np.cos(th)]
        thetas.append(keep)
        have += len(keep)
    th = np.concatenate(thetas)[:n]
    phi = rng.random(n) * (2 * math.pi)
    ring = big + a * np.cos(th)
    return np.stack([ring * np.cos(phi), ring * np.sin(phi), a + a * np.sin(th)], 1)


def _plane(n: int, p: dict, rng: np.random.Generator) -> np.ndarray:
    w, length, tilt = p["w"], p["l"], p["tilt"]
    u = (rng.random(n) - 0.5) * w
    s = rng.random(n) * length
    c = math.cos(tilt)
    return np.stack([u, s * c - length * c / 2, s * math.sin(tilt)], 1)


_SAMPLERS: dict[str, Callable[[int, dict, np.random.Generator], np.ndarray]] = {
    "box": _box, "sphere": _sphere, "cylinder": _cylinder, "cone": _cone, "torus": _torus,
    "plane": _plane,
}


def sample_surface(kind: str, p: dict, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` points (float64 [n, 3], metres) uniform on the surface of shape ``kind``."""
    if kind not in _SAMPLERS:
        raise ValueError(f"unknown shape {kind!r}; expected one of {SHAPES}")
    return _SAMPLERS[kind](int(n), p, rng)
