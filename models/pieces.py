"""A checkpoint tensor stored as several pieces (GPT-OSS's MXFP4 `*_blocks` and `*_scales`),
as a family's param_path names one; numpy only."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Piece:
    """param_path's answer for one stored piece of a tensor kept as several: the loader
    (backends/checkpoint.py) gathers the pieces, and once all have arrived maps
    combine({piece name: array}) by the name `tensor`."""

    tensor: str  # the combined tensor's name, which param_path maps
    piece: str  # this piece's name, e.g. "blocks"
    pieces: tuple  # every piece's name
    combine: Callable  # {piece: array} -> array
