"""A run's config as the flat key/value pairs trackers take: TensorBoard's HParams (trainer/observe/metrics.py) and
MLflow's params (trainer/observe/trackers/mlflow_tracker.py)."""

from typing import Any


def flat(config_dict: dict[str, Any], prefix: str = '') -> dict[str, bool | int | float | str]:
  """The config as dotted keys with the value types TensorBoard's HParams plugin accepts."""
  out = {}
  for key, value in config_dict.items():
    name = f'{prefix}{key}'
    if isinstance(value, dict):
      out.update(flat(value, name + '.'))
    elif isinstance(value, (bool, int, float, str)):
      out[name] = value
    else:  # None, tuples (axis rules): as text.
      out[name] = str(value)
  return out
