"""Weights & Biases: one run per launch (a resumed launch continues it), online or offline (log.wandb_mode).

An offline run is written under WORKDIR/wandb (a local temporary folder for gs:// workdirs) and uploaded later with
`wandb sync WORKDIR/wandb/offline-run-*`. The run's id is the run name's, so a relaunch after a preemption
appends to the same run instead of starting another.
"""

import hashlib
import tempfile

from trainer.base import storage


class WandbTracker:

  def __init__(self, settings, workdir: str, run_name: str, config_dict: dict, config_text: str):
    import wandb
    folder = storage.path(workdir)
    local = tempfile.mkdtemp(prefix='wandb-') if storage.is_cloud(folder) else str(folder)
    run_id = hashlib.sha1(f'{folder}:{run_name}'.encode()).hexdigest()[:16]
    self._run = wandb.init(project=settings.get('wandb_project', 'jax-launch'), name=run_name, id=run_id,
                           resume='allow', dir=local, mode=settings.get('wandb_mode', 'online'), config=config_dict,
                           reinit='create_new')
    self._run.summary['config_text'] = config_text

  def log(self, step: int, scalars: dict[str, float]) -> None:
    self._run.log(scalars, step=step)

  def goodput(self, step: int, scalars: dict[str, float], table: str) -> None:
    self._run.summary.update({**scalars, 'goodput/table': table})

  def close(self) -> None:
    self._run.finish()
