"""Python's cyclic garbage collector paused while remat works on a whole graph."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off for the duration, as it was before afterwards.

    - Capturing, profiling and planning make millions of short-lived objects (freed by
      reference counting as they go) while the heap holds a graph of tens of thousands of
      nodes, and each automatic collection walks that whole heap: on a 10,000-node graph
      it was about 40% of planning time.
    - A measured run: a collection in the middle would free objects that are not the
      step's and move what the allocator reports as held (seen once in 3000 random
      models, by 64 bytes at one node). No collection before it either: with torch loaded
      one costs tens of ms, more than a small step.

    Cycles made meanwhile are collected once it is back on.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
