"""Measuring a graph: per-node times and scratch (profiler), saved profiles, repeated
blocks, and the allocator's peaks."""
