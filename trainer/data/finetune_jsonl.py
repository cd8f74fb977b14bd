"""Fine-tuning examples from JSONL: one `{"prompt": ..., "completion": ...}` or `{"messages": [...]}` object a
line, to tokens and a loss mask.

Each line becomes one document: the prompt's tokens (after the tokenizer's
document prefix, e.g. BOS), then the completion's tokens and the end-of-sequence
token. The mask is 0 on the prompt's tokens and 1 on the completion's (its EOS
included): with data.loss_mask=True only completion tokens count in the loss,
while the prompt still feeds attention. A chat (`messages`, each a `role` and a
`content`) is rendered with the tokenizer's chat template, and the mask is 1 on
what each assistant turn adds (its content and end-of-turn tokens), 0 on the rest
(the template's own BOS, system and user turns, the assistant headers). scripts/prepare_data.py writes the pairs
into token shards (trainer/data/token_shards.py), where the mask travels with
the tokens through packing.
"""

import pathlib
from collections.abc import Callable, Sequence

import numpy as np

from trainer.base.errors import UserError
from trainer.data.corpus_formats import checked_text, json_lines

FIELDS = ('prompt', 'completion')
FORMS = '{"prompt": "...", "completion": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}'


def _chat(messages, render, encode_piece, where: str) -> tuple[list[int], list[int]]:
  """Tokens and mask of a conversation: what each assistant turn adds to the rendering is trained."""
  if (not isinstance(messages, list) or not messages
      or not all(isinstance(m, dict) and isinstance(m.get('role'), str) and isinstance(m.get('content'), str)
                 for m in messages)):
    raise UserError(f'{where}: "messages" must be a list of {{"role": ..., "content": ...}} objects (strings).')
  if not any(m['role'] == 'assistant' for m in messages):
    raise UserError(f'{where}: the conversation has no assistant message, so nothing to train on.')
  if render is None:
    raise UserError(f'{where} is a chat ("messages"), which needs --tokenizer with a chat template '
                    f'(tokenizer_config.json chat_template, or chat_template.jinja).')
  tokens, mask, done = [], [], ''
  for i, message in enumerate(messages):
    if message['role'] != 'assistant':
      continue
    before, through = render(messages[:i], True), render(messages[:i + 1], False)
    if not before.startswith(done) or not through.startswith(before):
      raise UserError(f'{where}: the chat template does not render the conversation turn by turn (a later turn '
                      f'changes earlier text), so the assistant turns cannot be masked.')
    prompt, answer = encode_piece(before[len(done):]), encode_piece(through[len(before):])
    tokens += [*prompt, *answer]
    mask += [0] * len(prompt) + [1] * len(answer)
    done = through
  rest = encode_piece(render(messages, False)[len(done):])  # Turns after the last answer: context only.
  return tokens + list(rest), mask + [0] * len(rest)


def read(path: pathlib.Path, encode_piece: Callable[[str], Sequence[int]], prefix: Sequence[int] = (),
         end: Sequence[int] = (), render_chat: Callable[[list, bool], str] | None = None,
         ) -> list[tuple[str, np.ndarray, np.ndarray]]:
  """(name 'file:line', tokens, mask) per line; one UserError naming the file and line of a bad one.

  `render_chat(messages, add_generation_prompt)` renders chats; None refuses them.
  """
  examples = []
  for where, record in json_lines(path):  # Undecodable bytes and bad JSON: one line naming it.
    if isinstance(record, dict) and 'messages' in record:
      tokens, mask = _chat(checked_text(record['messages'], where, '"messages"'), render_chat, encode_piece, where)
    elif isinstance(record, dict) and all(isinstance(record.get(k), str) for k in FIELDS):
      checked_text([record[k] for k in FIELDS], where, '"prompt" or "completion"')
      prompt = [*prefix, *encode_piece(record['prompt'])]
      completion = [*encode_piece(record['completion']), *end]
      tokens, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
    else:
      keys = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise UserError(f'{where} has {keys}, not the fields {list(FIELDS)} (two strings) or "messages"; each line of '
                      f'a fine-tuning file is {FORMS}.')
    examples.append((where, np.asarray(tokens, np.int64), np.asarray(mask, np.int64)))
  if not examples:
    raise UserError(f'{path} holds no examples; give one object a line: {FORMS}.')
  return examples
