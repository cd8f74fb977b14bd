"""What watches a run: the console, metrics and trackers, progress, goodput, profiles, FLOPs and MFU, idle experts."""
