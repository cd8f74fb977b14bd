"""Where a run's prepared data lives: the folder of scripts/prepare_data.py's meta.json and tokenizer/.

One place for the tools that read a run's tokenizer after training (sample.py, eval.py, export_hf.py): a run on
one prepared folder (`data.source='array_record'`) has it at `data.path`; a mixture's sources all hold the same
tokenizer (trainer/data/mixture.py refuses sources prepared with different ones), so its first source speaks for all.
"""

import pathlib


def folder(data) -> pathlib.Path | None:
  """The prepared folder of the run whose `config.data` is `data`; None for sources prepare_data.py did not write."""
  if data.source == 'array_record' and data.path:
    return pathlib.Path(data.path)
  if data.source == 'mixture' and data.get('mixture'):
    return pathlib.Path(data.mixture[0][0])
  return None
