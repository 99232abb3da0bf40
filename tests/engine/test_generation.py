from __future__ import annotations

import numpy as np

from qvld.engine.decoding.generation import mrope_positions

IMG = 99


def test_text_positions_are_sequential_on_all_axes() -> None:
    pos, delta = mrope_positions(4, [])
    assert delta == 0
    assert (pos == np.arange(4)).all()
    assert pos.shape == (3, 4)


def test_one_image_between_text() -> None:
    # 2 text tokens, a 2x3 merged grid (6 rows), then 2 text tokens.
    ids = [1, 2] + [IMG] * 6 + [3, 4]
    pos, delta = mrope_positions(len(ids), [(2, 2, 3)])
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    # Text resumes at base + max(gh, gw) = 2 + 3.
    assert pos[:, 8:].tolist() == [[5, 6]] * 3
    assert delta == 7 - len(ids)


def test_two_images_and_image_first() -> None:
    ids = [IMG] * 4 + [7] + [IMG] * 2 + [8]
    pos, delta = mrope_positions(len(ids), [(0, 2, 2), (5, 1, 2)])
    assert pos[:, :4].tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]
    assert pos[:, 4].tolist() == [2, 2, 2]
    assert pos[:, 5:7].tolist() == [[3, 3], [3, 3], [3, 4]]
    assert pos[:, 7].tolist() == [5, 5, 5]
    assert delta == 6 - len(ids)


def test_a_stray_image_token_in_text_is_text() -> None:
    # Generated text can contain the image-pad id; only real image spans are images.
    ids = [1, IMG, 2] + [IMG] * 4 + [3]
    pos, _ = mrope_positions(len(ids), [(3, 2, 2)])
    assert pos[:, :3].tolist() == [[0, 1, 2]] * 3
    assert pos[:, 3:7].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]
