"""Measuring what a plan does: peaks on the allocator, checks against eager, sweeps,
frontiers, baselines, and the files and plots they write."""
