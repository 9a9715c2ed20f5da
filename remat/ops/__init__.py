"""What remat knows of single ops: which inputs an aten op reads, writes or aliases, its
state-free twin, and the random-op replay that a recomputed copy of a random op runs."""
