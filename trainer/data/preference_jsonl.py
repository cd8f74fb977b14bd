"""Preference pairs from JSONL, the layout public datasets use (TRL's): to two masked documents each.

One object a line: `{"prompt": ..., "chosen": ..., "rejected": ...}`, where the
prompt is a string or a list of messages (also accepted as "messages"), and each
answer is a string or a list of assistant messages; or, with no prompt, "chosen"
and "rejected" are whole conversations whose shared first messages are the
prompt (Anthropic HH in TRL's conversational form). Each answer becomes one
document encoded as finetune_jsonl.py encodes a fine-tuning example: a string
prompt as the tokenizer's prefix (BOS), prompt + answer as one text, then EOS; a
conversation rendered whole by the tokenizer's chat template, the prompt with
its generation prompt, so its ids are apply_chat_template's. The mask is 1 on
the answer's tokens (its end-of-turn or EOS included), 0 on the prompt's.

A pair whose answers are empty or the same teaches nothing, and is refused with
the line it is on (the fix is the data's, so no retry helps).
"""

import pathlib
from collections.abc import Callable, Sequence

import numpy as np

from trainer.base.errors import UserError
from trainer.data.corpus_formats import checked_text, json_lines
from trainer.data.finetune_jsonl import masked_tokens

ANSWERS = ('chosen', 'rejected')
FORM = ('{"prompt": "..." or [messages], "chosen": "..." or [messages], "rejected": ...}, or "chosen"/"rejected" '
        'conversations that share their prompt')
Document = tuple[np.ndarray, np.ndarray]


def is_preference_record(record) -> bool:
  return isinstance(record, dict) and all(k in record for k in ANSWERS)


def _messages(value, where: str, key: str) -> list[dict]:
  if (not isinstance(value, list)
      or not all(isinstance(m, dict) and isinstance(m.get('role'), str) and isinstance(m.get('content'), str)
                 for m in value)):
    raise UserError(f'{where}: "{key}" must be a string or a list of {{"role": ..., "content": ...}} objects.')
  return value


def _parts(record: dict, where: str) -> tuple[object, object, object]:
  """(prompt, chosen, rejected): the prompt a string or messages, each answer a string or messages."""
  prompt = record.get('prompt', record.get('messages'))
  chosen, rejected = (record[k] if isinstance(record[k], str) else _messages(record[k], where, k) for k in ANSWERS)
  if prompt is None:
    if isinstance(chosen, str) or isinstance(rejected, str):
      raise UserError(f'{where} has no "prompt": give one, or give "chosen" and "rejected" as conversations that '
                      f'share their prompt messages; each line is {FORM}.')
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
      shared += 1
    prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
  elif not isinstance(prompt, str):
    prompt = _messages(prompt, where, 'prompt')
  for key, answer in zip(ANSWERS, (chosen, rejected)):
    if not (answer.strip() if isinstance(answer, str) else any(m['content'].strip() for m in answer)):
      raise UserError(f'{where}: the "{key}" answer is empty; a pair needs two different non-empty answers: fix or '
                      f'drop the line.')
  if chosen == rejected:
    raise UserError(f'{where}: "chosen" and "rejected" are the same answer, which teaches nothing: fix or drop the '
                    f'line.')
  return prompt, chosen, rejected


def _as_messages(part, role: str) -> list[dict]:
  """A string prompt or answer as the one message it is, in a conversation whose other part has messages."""
  return [{'role': role, 'content': part}] if isinstance(part, str) else part


def _document(prompt, answer, encode_piece, prefix, end, render, where: str) -> Document:
  """One answer's tokens and mask: string prompt and answer as one text between prefix and EOS, else a chat."""
  if isinstance(prompt, str) and isinstance(answer, str):
    text = prompt + answer
    ids, mask = masked_tokens(encode_piece, text, [(len(prompt), len(text))])
    ids, mask = [*prefix, *ids, *end], [0] * len(prefix) + mask + [1] * len(end)
  else:
    if render is None:
      raise UserError(f'{where} is a chat (messages), which needs --tokenizer with a chat template '
                      f'(tokenizer_config.json chat_template, or chat_template.jinja).')
    prompt_messages = _as_messages(prompt, 'user')
    before, through = render(prompt_messages, True), render(prompt_messages + _as_messages(answer, 'assistant'), False)
    if not through.startswith(before):
      raise UserError(f'{where}: the chat template renders the answer other than after its generation prompt '
                      f'(add_generation_prompt=True), so the answer cannot be told from the prompt.')
    ids, mask = masked_tokens(encode_piece, through, [(len(before), len(through))])
  if not any(mask) or len(ids) < 2:
    raise UserError(f'{where}: an answer encodes to no trained tokens; a pair needs two non-empty answers: fix or '
                    f'drop the line.')
  return np.asarray(ids, np.int64), np.asarray(mask, np.int64)


def read(path: pathlib.Path, encode_piece: Callable[[str], Sequence[int]], prefix: Sequence[int] = (),
         end: Sequence[int] = (), render_chat: Callable[[list, bool], str] | None = None,
         ) -> list[tuple[str, Document, Document]]:
  """(name 'file:line', chosen document, rejected document) per line; one UserError naming a bad line."""
  pairs = []
  for where, record in json_lines(path):
    if not is_preference_record(record):
      keys = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise UserError(f'{where} has {keys}, not "chosen" and "rejected"; each line of a preference file is {FORM}.')
    checked_text([record[k] for k in record if k in ('prompt', 'messages', *ANSWERS)], where, 'the pair')
    prompt, chosen, rejected = _parts(record, where)
    documents = [_document(prompt, answer, encode_piece, prefix, end, render_chat, where)
                 for answer in (chosen, rejected)]
    if np.array_equal(documents[0][0], documents[1][0]):
      raise UserError(f'{where}: "chosen" and "rejected" encode to the same tokens, which teaches nothing: fix or '
                      f'drop the line.')
    pairs.append((where, *documents))
  if not pairs:
    raise UserError(f'{path} holds no pairs; give one object a line: {FORM}.')
  return pairs
