"""Fine-tuning examples from JSONL: one `{"prompt": ..., "completion": ...}` or `{"messages": [...]}` object a
line, to tokens and a loss mask.

Each line becomes one document: the tokenizer's document prefix (e.g. BOS), the
tokens of the prompt and completion encoded together as one text, then the
end-of-sequence token. The mask is 0 on the prompt's tokens and 1 on the
completion's (its EOS included): with data.loss_mask=True only completion tokens
count in the loss, while the prompt still feeds attention. A chat (`messages`,
each a `role` and a `content`) is rendered with the tokenizer's chat template as
transformers renders it (trainer/data/chat_template.py) and encoded whole, so its
ids are apply_chat_template(tokenize=True)'s; the mask is 1 on what each
assistant turn adds (its content and end-of-turn tokens), 0 on the rest (the
template's own BOS, system and user turns, the assistant headers). A template
that rewrites earlier turns as the conversation grows (Qwen3) makes one document
per assistant turn instead (`_turns`). Where each part starts is found on the
whole text's tokens, never by encoding the parts apart: a SentencePiece-style
tokenizer would start each part with its own "▁". scripts/prepare_data.py writes
the documents into token shards (trainer/data/token_shards.py), where the mask
travels with the tokens through packing.
"""

import pathlib
from collections.abc import Callable, Sequence

import numpy as np

from trainer.base.errors import UserError
from trainer.data.corpus_formats import checked_text, json_lines

FIELDS = ('prompt', 'completion')
FORMS = '{"prompt": "...", "completion": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}'


def _split(encode_piece, text: str, cuts: Sequence[int]) -> tuple[list[int], list[int]]:
  """(ids of the whole `text`, the token index where each character offset in `cuts` falls).

  The text is encoded once, as a server encodes it: a SentencePiece-style tokenizer (Mistral, Llama 2) puts "▁"
  before the start of each piece it is given, so pieces encoded apart would differ from the whole. A cut's token
  index is where the ids of the text before it stop agreeing with the whole's; a token spanning the cut counts
  after it, as transformers' assistant mask counts a token that overlaps an assistant's text.
  """
  ids = list(encode_piece(text))
  found = []
  for cut in cuts:
    head = list(encode_piece(text[:cut])) if cut else []
    n = 0
    while n < min(len(head), len(ids)) and head[n] == ids[n]:
      n += 1
    found.append(n)
  return ids, found


def masked_tokens(encode_piece, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
  """Tokens of `text` and a mask of 1 on the tokens of its trained character `spans`."""
  ids, at = _split(encode_piece, text, [c for span in spans for c in span])
  mask = [0] * len(ids)
  for start, end in zip(at[::2], at[1::2]):
    mask[start:end] = [1] * (end - start)
  return ids, mask


def _turns(messages, render, where: str) -> list[tuple[str, list[tuple[int, int]]]]:
  """The documents a conversation trains as: (rendered text, character spans of its trained assistant turns).

  A template that renders turn by turn (each turn's text stays as later turns are added) makes one document whose
  every assistant turn is trained. One that rewrites earlier turns once later ones come (Qwen3 drops the <think>
  block of answers before the last question) makes one document per assistant turn, as its authors train it: the
  conversation up to that turn as the template renders it, with that turn trained and the earlier ones as context.
  """
  whole = render(messages, False)
  turns = []
  for i, message in enumerate(messages):
    if message['role'] == 'assistant':
      before, through = render(messages[:i], True), render(messages[:i + 1], False)
      if not through.startswith(before):
        raise UserError(f'{where}: the chat template renders assistant turn {i} other than after its generation '
                        f'prompt (add_generation_prompt=True), so its answer cannot be told from the prompt.')
      turns.append((before, through))
  in_order = all(len(b) >= len(t) for (_, t), (b, _) in zip(turns, turns[1:]))
  if in_order and all(whole.startswith(through) for _, through in turns):
    return [(whole, [(len(before), len(through)) for before, through in turns])]
  return [(through, [(len(before), len(through))]) for before, through in turns]


def _chat(messages, render, encode_piece, where: str) -> list[tuple[list[int], list[int]]]:
  """Tokens and mask of each document of a conversation: what each assistant turn adds to the rendering is
  trained, the rest (the template's own BOS, system and user turns, the assistant headers) is context."""
  if (not isinstance(messages, list) or not messages
      or not all(isinstance(m, dict) and isinstance(m.get('role'), str) and isinstance(m.get('content'), str)
                 for m in messages)):
    raise UserError(f'{where}: "messages" must be a list of {{"role": ..., "content": ...}} objects (strings).')
  if not any(m['role'] == 'assistant' for m in messages):
    raise UserError(f'{where}: the conversation has no assistant message, so nothing to train on.')
  if render is None:
    raise UserError(f'{where} is a chat ("messages"), which needs --tokenizer with a chat template '
                    f'(tokenizer_config.json chat_template, or chat_template.jinja).')
  return [masked_tokens(encode_piece, text, spans) for text, spans in _turns(messages, render, where)]


def read(path: pathlib.Path, encode_piece: Callable[[str], Sequence[int]], prefix: Sequence[int] = (),
         end: Sequence[int] = (), render_chat: Callable[[list, bool], str] | None = None,
         ) -> list[tuple[str, np.ndarray, np.ndarray]]:
  """(name 'file:line', tokens, mask) per line; one UserError naming the file and line of a bad one.

  `render_chat(messages, add_generation_prompt)` renders chats; None refuses them.
  """
  examples = []
  for where, record in json_lines(path):  # Undecodable bytes and bad JSON: one line naming it.
    if isinstance(record, dict) and 'messages' in record:
      documents = _chat(checked_text(record['messages'], where, '"messages"'), render_chat, encode_piece, where)
    elif isinstance(record, dict) and all(isinstance(record.get(k), str) for k in FIELDS):
      checked_text([record[k] for k in FIELDS], where, '"prompt" or "completion"')
      text = record['prompt'] + record['completion']
      ids, mask = masked_tokens(encode_piece, text, [(len(record['prompt']), len(text))])
      documents = [([*prefix, *ids, *end], [0] * len(prefix) + mask + [1] * len(end))]
    else:
      keys = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise UserError(f'{where} has {keys}, not the fields {list(FIELDS)} (two strings) or "messages"; each line of '
                      f'a fine-tuning file is {FORMS}.')
    for tokens, mask in documents:  # A chat trained turn by turn makes several, named alike: one split for all.
      examples.append((where, np.asarray(tokens, np.int64), np.asarray(mask, np.int64)))
  if not examples:
    raise UserError(f'{path} holds no examples; give one object a line: {FORMS}.')
  return examples
