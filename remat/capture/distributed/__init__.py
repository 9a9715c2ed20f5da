"""Data parallelism in the graph: DDP's gradient all-reduces (`data_parallel`) and FSDP2's
local shards, gathers and reduce-scatters (`sharded`), with the gradients' norm across the
ranks (`sharded_norms`) and the mixed-precision policy's casts (`sharded_precision`)."""
