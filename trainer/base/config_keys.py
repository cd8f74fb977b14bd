"""The keys a config may set: those configs/base.py declares. A config file is checked like the command line.

A ConfigDict is open: `c.train.stepz = 10` in a file adds a key nobody reads and the
run trains with the default, while `--config.train.stepz=10` is refused. launch.py
checks a loaded config's keys against base.get_config() so both are refused alike,
with the nearest declared key as a suggestion.
"""

import difflib

from configs import base


def _paths(config, prefix: str = '') -> list[str]:
  found = []
  for key, value in config.items():
    if hasattr(value, 'items') and not isinstance(value, dict):  # A section (ConfigDict), not a value.
      found += _paths(value, f'{prefix}{key}.')
    else:
      found.append(f'{prefix}{key}')
  return found


def unknown(config) -> list[str]:
  """One message per key of `config` that configs/base.py does not declare, with the closest declared key."""
  declared = _paths(base.get_config())
  messages = []
  for path in _paths(config):
    if path in declared:
      continue
    close = difflib.get_close_matches(path, declared, n=1, cutoff=0.6)
    messages.append(f'{path}' + (f' (did you mean {close[0]}?)' if close else ''))
  return messages
