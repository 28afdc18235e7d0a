"""Deterministic test images (real PIL images, different sizes and content)."""
from __future__ import annotations

import numpy as np
from PIL import Image


def make_image(seed: int, size: tuple[int, int] = (64, 80)) -> Image.Image:
    """A reproducible RGB image: smooth gradients plus seeded noise, so images differ."""
    rng = np.random.default_rng(seed)
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * (seed + 3)) % 256, (yy * (seed + 5)) % 256, ((xx + yy) * 7) % 256], -1)
    noise = rng.integers(0, 64, (h, w, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))
