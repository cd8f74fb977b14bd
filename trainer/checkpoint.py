"""Orbax checkpoints of the train state, the Grain iterator and a run manifest.

Layout: WORKDIR/checkpoints/<step>/{state,data,manifest}. The manifest records
what the state was built from (model config, parameter shapes, versions,
mesh), so a workdir holding another model's checkpoints is refused with a
clear message before anything is compiled or restored.
"""

import pathlib
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from trainer.errors import UserError


def param_shapes(params) -> dict[str, list[int]]:
  """{'block_0/mlp/up/kernel': [d, f], ...}: the shape signature of a parameter tree."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {'/'.join(str(getattr(k, 'key', k)) for k in path): list(leaf.shape) for path, leaf in flat}


class Checkpointer:
  """Saves every `ckpt.every_steps` (and on demand), restores the newest, guards against foreign workdirs."""

  def __init__(self, workdir: str, ckpt_config):
    self.directory = pathlib.Path(workdir).absolute() / 'checkpoints'
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=ckpt_config.every_steps,
        max_to_keep=ckpt_config.max_to_keep,
        enable_async_checkpointing=ckpt_config.async_save,
        create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def check_compatible(self, step: int, manifest: dict[str, Any]) -> None:
    """Raises UserError if the checkpoint at `step` holds a different model than `manifest` describes."""
    try:
      saved = self._manager.restore(step, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))['manifest']
    except Exception as e:  # Any failure here means we cannot trust this checkpoint for resuming.
      raise UserError(f'checkpoint {self.directory / str(step)} has no readable manifest ({type(e).__name__}); '
                      f'it was not written by this launcher or is damaged. Use a fresh --workdir.') from e
    diffs = [f'model.{k}: checkpoint {saved["model"].get(k)!r} vs config {v!r}'
             for k, v in manifest['model'].items() if saved['model'].get(k) != v]
    if not diffs and saved['param_shapes'] != manifest['param_shapes']:
      diffs = ['parameter shapes differ']
    if diffs:
      raise UserError(f'--workdir holds checkpoints of a different model ({"; ".join(diffs[:4])}) in '
                      f'{self.directory}. Resume with the config it was trained with, or use a fresh --workdir; '
                      f'nothing was changed.')
    # Another process count is fine: the data position is a count of global examples (trainer/data/pipeline.py).

  def save(self, step: int, state, data_iterator: grain.DatasetIterator, manifest: dict[str, Any],
           force: bool = False) -> bool:
    """Starts a save if `step` is due (or `force`); returns whether one started."""
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_iterator.get_state()),
        manifest=ocp.args.JsonSave(manifest))
    return self._manager.save(step, args=args, force=force)

  def restore(self, step: int, abstract_state_with_shardings, data_iterator: grain.DatasetIterator):
    """Restores the state straight into its target shardings and rewinds the data iterator."""
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state_with_shardings),
        data=ocp.args.JsonRestore())
    restored = self._manager.restore(step, args=args)
    data_iterator.set_state(restored['data'])  # Same position on every process, for any process count.
    return restored['state']

  def close(self) -> None:
    """Waits for any save in flight, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
