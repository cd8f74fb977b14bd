"""A finished checkpoint that cannot be read is moved aside to WORKDIR/damaged_checkpoints/, never deleted.

Left in place, a damaged `checkpoints/12/` makes the run fall back to step 8
and then die at step 12 with Orbax's StepAlreadyExistsError, at every
relaunch. Moved aside, the run trains through step 12 and saves it again.

Why outside checkpoints/: Orbax lists every integer-named folder there as a
step, and its retention (max_to_keep) deletes among those; a copy anywhere
under checkpoints/ would be listed, restored from, or deleted.
"""

import time

import jax
from absl import logging

from trainer.base import storage

FOLDER = 'damaged_checkpoints'


def move_aside(checkpoints: storage.Path, step: int, why: str) -> storage.Path:
  """Moves checkpoints/<step> to WORKDIR/damaged_checkpoints/<step>-<UTC time>/ (process 0); returns the target.

  Every process gets the same target; call it on all of them, then reload the
  checkpoint manager's step list.
  """
  target = checkpoints.parent / FOLDER / f'{step}-{time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())}'
  if jax.process_index() == 0:
    while target.exists():  # Two damaged copies of one step within a second: keep both.
      target = target.with_name(target.name + '+')
    storage.move(checkpoints / str(step), target)
    logging.warning('Checkpoint %s is damaged (%s): moved to %s (kept, not deleted); step %d will be trained and '
                    'saved again.', checkpoints / str(step), why, target, step)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(f'damaged checkpoint {step} moved')
  return target
