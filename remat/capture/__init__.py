"""Capture: one training iteration traced into one graph (TrainGraph), the checks on what
the trace may hold, the optimizers' and data parallelism's parts of it, and the inputs of
each call."""
