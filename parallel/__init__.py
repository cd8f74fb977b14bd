"""Device mesh, shardings and partitioning strategies."""
