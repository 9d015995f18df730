"""whole_cache_arrays(hlo, elements): the instructions of a compiled step that build an array
the size of the whole KV cache (a step must convert, copy or quantize no more than its own
pages), and NUM_BLOCKS, a cache size no other array of the step has
(backends/test_kv_cache_dtype.py, kernels/test_kv_cache_quant.py, kernels/test_mla_kv_quant.py)."""

from __future__ import annotations

import math
import re

NUM_BLOCKS = 1031  # prime: no other array of the step has the cache's element count
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\(")
_COMPUTATION = re.compile(r"^\s*(ENTRY )?%(\S+) \(.*\{\s*$")
_CALLS = re.compile(r"calls=%([\w.-]+)")
_FREE = {"parameter", "get-tuple-element", "bitcast", "tuple", "while", "conditional", "call"}


def whole_cache_arrays(hlo: str, elements: int) -> list[str]:
    """Instructions of optimized HLO text that produce an array of `elements` elements, other
    than views (parameter, bitcast, tuple plumbing, loops) and scatters into it (a fusion
    whose root is a scatter or dynamic-update-slice counts as one)."""
    roots: dict[str, str] = {}
    current = None
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(2)
        elif (m := _INSTRUCTION.match(line)) and m.group(1) and current:
            roots[current] = m.group(4)
    found = []
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if not m or not m.group(3):
            continue
        if math.prod(int(d) for d in m.group(3).split(",")) != elements:
            continue
        op = m.group(4)
        if op in _FREE or op in ("scatter", "dynamic-update-slice"):
            continue
        if op == "fusion" and (c := _CALLS.search(line)) and roots.get(c.group(1)) in (
                "scatter", "dynamic-update-slice"):
            continue
        found.append(line.strip()[:160])
    return found
