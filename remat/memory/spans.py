"""Rank spans [lo, hi] over the captured order: how long a value or a copy lives."""

from __future__ import annotations


def merge_spans(spans: dict[int, list[tuple[int, int]]]) -> dict[int, list[tuple[int, int]]]:
    """Each storage's rank spans, sorted, overlapping ones merged (storages without any left out)."""
    merged: dict[int, list[tuple[int, int]]] = {}
    for s, xs in spans.items():
        out: list[tuple[int, int]] = []
        for lo, hi in sorted(xs):
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        if out:
            merged[s] = out
    return merged
