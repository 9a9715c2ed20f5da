"""Python's cyclic garbage collector paused while remat works on a whole graph."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off for the duration, as it was before afterwards.

    Capturing, profiling and planning make millions of short-lived objects (freed by
    reference counting as they go) while the heap holds a graph of tens of thousands of
    nodes, and each automatic collection walks that whole heap: on a 10,000-node graph it
    was about 40% of planning time. Cycles made meanwhile are collected once it is back on.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
