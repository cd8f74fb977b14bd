"""Run safety: what keeps a run's work from being lost or overwritten when things go wrong.

- workdir.py: the --workdir is checked before anything is compiled or written
  (a URL scheme the launcher cannot write, a file, a read-only folder, a missing
  or unwritable gs:// bucket);
- lock.py: one launch per workdir at a time (WORKDIR/launch.lock: a flock on
  disk, an object created only if absent in a bucket);
- damaged.py: a checkpoint that cannot be read is moved aside, never deleted;
- disk.py: a save that fails for lack of space or permission ends in one line;
- tool_outputs.py: a tool's output (an export, an eval's results) appears whole or not at all.

Ctrl-C is handled with SIGTERM in trainer/safety/preemption.py, a lost peer in
parallel/watchdog.py.
"""
