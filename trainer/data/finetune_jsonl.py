"""Fine-tuning examples from JSONL: one `{"prompt": ..., "completion": ...}` object a line, to tokens and a loss mask.

Each line becomes one document: the prompt's tokens (after the tokenizer's
document prefix, e.g. BOS), then the completion's tokens and the end-of-sequence
token. The mask is 0 on the prompt's tokens and 1 on the completion's (its EOS
included): with data.loss_mask=True only completion tokens count in the loss,
while the prompt still feeds attention. scripts/prepare_data.py writes the pairs
into token shards (trainer/data/token_shards.py), where the mask travels with
the tokens through packing.
"""

import json
import pathlib
from collections.abc import Callable, Sequence

import numpy as np

from trainer.errors import UserError

FIELDS = ('prompt', 'completion')


def read(path: pathlib.Path, encode_piece: Callable[[str], Sequence[int]], prefix: Sequence[int] = (),
         end: Sequence[int] = ()) -> list[tuple[str, np.ndarray, np.ndarray]]:
  """(name 'file:line', tokens, mask) per line; one UserError naming the file and line of a bad one."""
  examples = []
  for number, line in enumerate(path.read_text().splitlines(), start=1):
    if not line.strip():
      continue
    where = f'{path}:{number}'
    try:
      record = json.loads(line)
    except ValueError as e:
      raise UserError(f'{where} is not a JSON object ({e.msg}); each line of a fine-tuning file is '
                      f'{{"prompt": "...", "completion": "..."}}.') from None
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in FIELDS):
      keys = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise UserError(f'{where} has {keys}, not the fields {list(FIELDS)} (two strings); each line of a fine-tuning '
                      f'file is {{"prompt": "...", "completion": "..."}}.')
    prompt = [*prefix, *encode_piece(record['prompt'])]
    completion = [*encode_piece(record['completion']), *end]
    tokens = np.asarray(prompt + completion, np.int64)
    mask = np.concatenate([np.zeros(len(prompt), np.int64), np.ones(len(completion), np.int64)])
    examples.append((where, tokens, mask))
  if not examples:
    raise UserError(f'{path} holds no examples; give one {{"prompt": ..., "completion": ...}} object a line.')
  return examples
