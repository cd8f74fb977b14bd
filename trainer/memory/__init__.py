"""Device memory before the first step: the compiled step's footprint, the pre-flight check, remat 'auto'."""
