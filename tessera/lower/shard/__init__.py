"""Distribution: the mesh, logical→mesh rules, collectives, deterministic reductions and sharded steps."""
