"""CUDA graphs of the torch backend's forward pass, one per (T, R) bucket: where the JAX
backend compiles a step per bucket (bucket_compiler.py), the torch runner on a GPU captures
the forward pass of each bucket once and replays it, so a step's host cost stays flat however
many layers the model has. The Triton kernels read no lengths on the host, so a graph
replays any batch of its bucket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from jaxserve.backends.torch.batch import BATCH_NAMES, TorchBatch

logger = logging.getLogger(__name__)


class GraphCache:
    """The forward pass of each (T, R) bucket as a CUDA graph over static input tensors:
    captured on first use or by capture_all, then replayed after copying a step's batch
    into its inputs. forward(batch) -> hidden [T, D] runs the model on the runner's own KV
    caches and weights, so a replay writes the live cache in place; empty_batch(T, R) is
    the batch of a step with no rows (it writes only into the null block 0, so capturing
    on the live cache is safe)."""

    def __init__(self, forward: Callable[[TorchBatch], torch.Tensor],
                 empty_batch: Callable[[int, int], TorchBatch],
                 buckets: list[tuple[int, int]]) -> None:
        self.forward_fn, self.empty_batch, self.buckets = forward, empty_batch, buckets
        self.graphs: dict[tuple[int, int], tuple] = {}  # bucket -> (graph, inputs, hidden)
        self.pool = None

    def capture_all(self) -> None:
        from jaxserve.config.progress import progress

        start = time.perf_counter()
        for num_tokens, num_rows in progress(self.buckets, desc="Capturing CUDA graphs",
                                             unit="bucket"):
            self._capture(num_tokens, num_rows)
        logger.info("Captured %d CUDA graphs in %.1f s.", len(self.buckets),
                    time.perf_counter() - start)

    def forward(self, batch: TorchBatch, num_tokens: int, num_rows: int) -> torch.Tensor:
        graph, inputs, hidden = self._capture(num_tokens, num_rows)
        for field in BATCH_NAMES:
            getattr(inputs, field).copy_(getattr(batch, field), non_blocking=True)
        graph.replay()
        return hidden

    @torch.no_grad()
    def _capture(self, num_tokens: int, num_rows: int):
        key = (num_tokens, num_rows)
        if key in self.graphs:
            return self.graphs[key]
        empty = self.empty_batch(num_tokens, num_rows)
        inputs = TorchBatch(**{name: getattr(empty, name).clone() for name in BATCH_NAMES})
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the Triton kernels before the capture
                self.forward_fn(inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.forward_fn(inputs)
        self.pool = graph.pool()
        self.graphs[key] = (graph, inputs, hidden)
        return self.graphs[key]
