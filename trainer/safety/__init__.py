"""Run safety: what keeps a run's work from being lost or overwritten when things go wrong.

- workdir.py: the --workdir is checked before anything is compiled or written
  (a URL scheme the launcher cannot write, a file, a read-only folder);
- lock.py: one launch per workdir at a time (WORKDIR/launch.lock);
- damaged.py: a checkpoint that cannot be read is moved aside, never deleted;
- disk.py: a save that fails for lack of space or permission ends in one line.

Ctrl-C is handled with SIGTERM in trainer/preemption.py, a lost peer in
parallel/watchdog.py.
"""
