"""MLflow: one run per launch under log.mlflow_experiment, at log.mlflow_tracking_uri (any URI MLflow takes).

With no URI set, MLFLOW_TRACKING_URI if the environment has one, else the folder WORKDIR/mlruns. MLflow 3
refuses a local folder (its file store is in maintenance mode) unless MLFLOW_ALLOW_FILE_STORE=true, which this
tracker sets for folder URIs only: the folder is what an air-gapped run can write (`mlflow ui
--backend-store-uri WORKDIR/mlruns` reads it). The config goes in as parameters (dotted keys), and as config.txt;
the goodput table as goodput.txt.
"""

import os

from trainer.base import storage
from trainer.observe.trackers import hparams

_PARAMS_PER_CALL = 100  # MLflow's log_batch limit on parameters.
_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value.


def tracking_uri(settings, workdir: str) -> str:
  uri = settings.get('mlflow_tracking_uri') or os.environ.get('MLFLOW_TRACKING_URI')
  if uri:
    return uri
  return str(storage.path(workdir) / 'mlruns')


class MlflowTracker:

  def __init__(self, settings, workdir: str, run_name: str, config_dict: dict, config_text: str):
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(settings, workdir)
    if '://' not in uri or uri.startswith('file:'):
      os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')
    self._client = client = MlflowClient(tracking_uri=uri)
    name = settings.get('mlflow_experiment', 'jax-launch')
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    self._run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
    params = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in hparams.flat(config_dict).items()]
    for i in range(0, len(params), _PARAMS_PER_CALL):
      client.log_batch(self._run_id, params=params[i:i + _PARAMS_PER_CALL])
    client.log_text(self._run_id, config_text, 'config.txt')

  def log(self, step: int, scalars: dict[str, float]) -> None:
    from mlflow.entities import Metric
    import time
    now = int(time.time() * 1000)
    self._client.log_batch(self._run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

  def goodput(self, step: int, scalars: dict[str, float], table: str) -> None:
    self.log(step, scalars)
    self._client.log_text(self._run_id, table, 'goodput.txt')

  def close(self) -> None:
    self._client.set_terminated(self._run_id)
