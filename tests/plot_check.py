"""Reading a plot's pixels: where a colour is, in the PNG a command wrote, at the place
matplotlib's own transform puts a training step. Screenshots go to ``screenshots/``
(git-ignored)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "screenshots"  # git-ignored


def keep(png: Path, name: str) -> Path:
    """Copy ``png`` to screenshots/NAME (git-ignored), to look at."""
    SHOTS.mkdir(exist_ok=True)
    dest = SHOTS / name
    shutil.copyfile(png, dest)
    return dest


def pixels(png: Path) -> np.ndarray:
    """The image as uint8 RGB, row 0 at the top."""
    from matplotlib.image import imread

    img = imread(png)
    if img.dtype != np.uint8:
        img = np.round(img * 255).astype(np.uint8)
    return img[..., :3]


def rgb(color: str) -> np.ndarray:
    from matplotlib.colors import to_rgb

    return np.round(np.array(to_rgb(color)) * 255).astype(int)


def mask(img: np.ndarray, color: str, tol: int = 6) -> np.ndarray:
    """Pixels within ``tol`` per channel of ``color``."""
    return (np.abs(img.astype(int) - rgb(color)) <= tol).all(axis=-1)


def box(fig, ax) -> tuple[int, int, int, int]:
    """The axes' data area in image pixels: (row0, row1, col0, col1), rows from the top."""
    h = fig.canvas.get_width_height()[1]
    (x0, y0), (x1, y1) = (map(float, p) for p in ax.get_window_extent().get_points())
    return round(h - y1) + 2, round(h - y0) - 2, round(x0) + 2, round(x1) - 2


def column(fig, ax, step: float) -> int:
    """The image column where ``step`` sits on ``ax``'s x axis."""
    return round(float(ax.transData.transform((step, 1.0))[0]))


def share_at(img: np.ndarray, fig, ax, step: float, color: str, *, half: int = 2) -> float:
    """Share of the axes' rows that hold ``color`` within ``half`` columns of ``step``."""
    r0, r1, _, _ = box(fig, ax)
    c = column(fig, ax, step)
    hit = mask(img[r0:r1, c - half:c + half + 1], color).any(axis=1)
    return float(hit.mean())


def inside(img: np.ndarray, fig, ax, color: str) -> np.ndarray:
    """The columns (image x) inside ``ax`` that hold ``color`` anywhere in the data area."""
    r0, r1, c0, c1 = box(fig, ax)
    return np.nonzero(mask(img[r0:r1, c0:c1], color).any(axis=0))[0] + c0
