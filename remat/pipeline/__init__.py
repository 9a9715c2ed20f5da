"""The pipeline: capture → analyze → profile → index → schedule → rewrite (docs/DESIGN.md).

`build.build` runs the first four on a training step; the memory model's rules live in
`graph_index` (what a rebuild block copies, how long a copy lives, what may be
recomputed), `schedule` (the order that runs) and `simulator` (the bytes it holds).
"""
