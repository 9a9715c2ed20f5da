"""The memory model: the analysis of a graph's storages, the index every rule reads, the
schedule of a plan and its simulation."""
