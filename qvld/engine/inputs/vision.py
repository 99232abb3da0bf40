"""Vision submodels -> image embeddings and deepstack features, one image at a time.

Per image: patch embedding (vision_embeddings) + bilinearly interpolated position
embeddings (vision_embeddings_pos gives the 4 corner rows; the weights are applied
here) -> merger with 2D rotary embeddings and the image's attention mask. Images are
encoded separately: their attention blocks are independent, so this equals one
block-diagonal batch, with a smaller mask, and each image can be cached on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qvld.engine.inputs.image import PreparedImage
from qvld.engine.model.interface import Slot
from qvld.engine.model.model_dir import VisionSpec


@dataclass(frozen=True)
class ImageEmbedding:
    embeds: np.ndarray  # [tokens, H]
    deepstack: np.ndarray  # [k, tokens, H]


def torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """float32 linspace as torch computes it on CPU, so the bilinear floors agree.

    torch rounds the step to float32, evaluates start + step·i (first half) and
    end - step·(steps-1-i) (second half) with a fused multiply-add, then rounds.
    """
    if steps == 1:
        return np.array([start], dtype=np.float32)
    step = np.float64(np.float32((end - start) / (steps - 1)))
    idx = np.arange(steps)
    half = steps // 2
    lo = start + step * idx[:half]
    hi = end - step * (steps - 1 - idx[half:])
    return np.concatenate([lo, hi]).astype(np.float32)


def position_corners(grid_h: int, grid_w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Corner indices [4,h*w] into the side×side table and their bilinear weights [4,h*w]."""
    h = torch_linspace(0, side - 1, grid_h)
    w = torch_linspace(0, side - 1, grid_w)
    h0, w0 = h.astype(np.int64), w.astype(np.int64)
    h1, w1 = np.minimum(h0 + 1, side - 1), np.minimum(w0 + 1, side - 1)
    dh, dw = (h - h0).astype(np.float32), (w - w0).astype(np.float32)
    one = np.float32(1)
    idx = np.stack([
        (h0[:, None] * side + w0[None]).ravel(),
        (h0[:, None] * side + w1[None]).ravel(),
        (h1[:, None] * side + w0[None]).ravel(),
        (h1[:, None] * side + w1[None]).ravel(),
    ])
    weights = np.stack([
        ((one - dh)[:, None] * (one - dw)[None]).ravel(),
        ((one - dh)[:, None] * dw[None]).ravel(),
        (dh[:, None] * (one - dw)[None]).ravel(),
        (dh[:, None] * dw[None]).ravel(),
    ]).astype(np.float32)
    return idx, weights


def to_merge_order(rows: np.ndarray, grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """Raster-order rows [h*w, D] -> the 2x2 merge-block order of the patches."""
    d = rows.shape[-1]
    x = rows.reshape(grid_h // merge, merge, grid_w // merge, merge, d)
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3, 4).reshape(grid_h * grid_w, d))


def rotary_embedding(grid_h: int, grid_w: int, merge: int, head_dim: int) -> np.ndarray:
    """2D rotary angles [h*w, head_dim/2] (rows then columns) in merge-block order."""
    dim = head_dim // 2
    inv_freq = np.float32(1.0) / (
        np.float32(10000.0) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    table = np.outer(np.arange(max(grid_h, grid_w), dtype=np.float32), inv_freq)
    rows = np.arange(grid_h)[:, None].repeat(grid_w, 1)
    cols = np.arange(grid_w)[None, :].repeat(grid_h, 0)
    coords = np.stack([rows, cols], axis=-1).reshape(grid_h * grid_w, 2)
    coords = to_merge_order(coords, grid_h, grid_w, merge)
    return np.ascontiguousarray(table[coords].reshape(grid_h * grid_w, -1), dtype=np.float32)


def encode_image(slot: Slot, image: PreparedImage, vision: VisionSpec) -> ImageEmbedding:
    """The image's (or frame pair's) embeddings and deepstack features, on ``slot``.

    A pruned frame pair (``image.keep``) is encoded from its kept tokens' patches only,
    each with the position embedding and rotary angles it has in the whole pair: the
    encoder's work shrinks with the tokens, and its attention sees the kept patches."""
    gh, gw, m = image.grid_h, image.grid_w, image.merge_size
    assert image.patches is not None, "decode the image before encoding it"
    side = round(vision.num_position_embeddings ** 0.5)
    idx, weights = position_corners(gh, gw, side)
    corners = slot.vision_positions(idx) * weights[:, :, None]
    pos = to_merge_order(corners[0] + corners[1] + corners[2] + corners[3], gh, gw, m)
    rotary = rotary_embedding(gh, gw, m, vision.hidden_size // vision.num_heads)
    patches = image.patches
    if image.keep is not None:  # each merged token is m*m consecutive patch rows
        rows = (image.keep[:, None] * (m * m) + np.arange(m * m)).reshape(-1)
        patches, pos, rotary = patches[rows], pos[rows], rotary[rows]
    hidden = slot.vision_patches(np.ascontiguousarray(patches)) + pos
    n = len(hidden)
    mask = np.zeros((1, n, n), dtype=np.float32)
    embeds, deepstack = slot.vision_merge(hidden, mask, np.ascontiguousarray(rotary))
    return ImageEmbedding(embeds=embeds, deepstack=deepstack)
