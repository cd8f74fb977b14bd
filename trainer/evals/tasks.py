"""Task files: JSONL in the lm-eval-harness multiple-choice shape, read and checked before any compile.

One question a line:

  {"context": "The sky is", "choices": ["blue", "green"], "gold": 0}

or, for a sample-based task (scripts/eval.py only: generate until a stop string, exact match):

  {"context": "2+2=", "answer": "4", "stop": ["\\n"]}

An optional first line sets how questions are shown, as lm-eval's task YAML does:

  {"template": "Question: {context}\\nAnswer:", "target_delimiter": " ", "fewshot_delimiter": "\\n\\n",
   "fewshot": [{"context": ..., "choices": [...], "gold": 0}, ...]}

A question's prompt is the few-shot examples (each its templated context, the delimiter and its gold choice or
answer) joined by fewshot_delimiter, then its own templated context; a choice's continuation is target_delimiter
and the choice, as lm-eval requests it. acc_norm divides by the choice's length in characters, as lm-eval does.
A bad line is one UserError naming the file and the line.
"""

import dataclasses
import json
import pathlib

from trainer.base.errors import UserError

HEADER_KEYS = ('template', 'target_delimiter', 'fewshot_delimiter', 'fewshot')


@dataclasses.dataclass(frozen=True)
class Question:
  prompt: str  # Few-shot examples and the templated context: what every continuation is scored after.
  continuations: tuple[str, ...]  # target_delimiter + choice, per choice (multiple choice); empty for sample-based.
  choice_chars: tuple[int, ...]  # len(choice) without the delimiter, per choice: acc_norm's divisor.
  gold: int  # Index of the right choice; -1 for sample-based.
  answer: str = ''  # Sample-based: the exact answer expected.
  stop: tuple[str, ...] = ()  # Sample-based: generation ends at the first of these.
  line: int = 0  # 1-based line in the task file.


@dataclasses.dataclass(frozen=True)
class TaskFile:
  name: str  # The file's stem: metrics are eval_<name>_acc, eval_<name>_acc_norm, eval_<name>_exact_match.
  path: str
  kind: str  # 'multiple_choice' or 'generate'.
  questions: tuple[Question, ...]


def _bad(path, line: int, why: str) -> UserError:
  return UserError(f'eval task file {path}, line {line}: {why}')


def _example(record, path, line: int) -> tuple[str, dict]:
  """('multiple_choice' | 'generate', the record's checked fields)."""
  if not isinstance(record, dict):
    raise _bad(path, line, f'expected a JSON object, got {type(record).__name__}.')
  context = record.get('context')
  if not isinstance(context, str) or not context:
    raise _bad(path, line, '"context" must be a non-empty string.')
  if 'choices' in record:
    choices, gold = record['choices'], record.get('gold')
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
      raise _bad(path, line, '"choices" must be a list of at least 2 non-empty strings.')
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
      raise _bad(path, line, f'"gold" must be an integer index into the {len(choices)} choices, got {gold!r}.')
    return 'multiple_choice', {'context': context, 'choices': choices, 'gold': gold}
  if 'answer' in record:
    answer, stop = record['answer'], record.get('stop', ['\n'])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(answer, str) or not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
      raise _bad(path, line, '"answer" must be a string and "stop" a non-empty string or a list of them.')
    return 'generate', {'context': context, 'answer': answer, 'stop': tuple(stop)}
  raise _bad(path, line, 'give "choices" and "gold" (multiple choice) or "answer" (sample-based); '
                         f'found keys {sorted(record)}.')


def _header(record, path, line: int = 1) -> dict:
  unknown = sorted(set(record) - set(HEADER_KEYS))
  if unknown:
    raise _bad(path, line, f'a header line takes only {", ".join(HEADER_KEYS)}; unknown: {", ".join(unknown)}.')
  header = {'template': '{context}', 'target_delimiter': ' ', 'fewshot_delimiter': '\n\n', 'fewshot': []}
  header.update(record)
  for key in ('template', 'target_delimiter', 'fewshot_delimiter'):
    if not isinstance(header[key], str):
      raise _bad(path, line, f'"{key}" must be a string.')
  if '{context}' not in header['template']:
    raise _bad(path, line, f'"template" must contain {{context}}, got {header["template"]!r}.')
  if not isinstance(header['fewshot'], list):
    raise _bad(path, line, '"fewshot" must be a list of examples.')
  return header


def _shown(header: dict, context: str) -> str:
  return header['template'].replace('{context}', context)


def load(path: str, max_questions: int = 0) -> TaskFile:
  """The task file at `path`, every line checked; `max_questions` > 0 keeps the first that many questions."""
  p = pathlib.Path(path)
  if not p.is_file():
    raise UserError(f'eval task file {path} not found; eval.tasks (or --tasks) names JSONL files '
                    f'(docs/evals.md).')
  header, kind, questions, header_line = None, None, [], 1
  for number, text in enumerate(p.read_text(encoding='utf-8').splitlines(), start=1):
    if not text.strip():
      continue
    try:
      record = json.loads(text)
    except json.JSONDecodeError as e:
      raise _bad(path, number, f'not valid JSON ({e.msg} at column {e.colno}).') from None
    if isinstance(record, dict) and 'context' not in record and set(record) & set(HEADER_KEYS):
      if header is not None or questions:
        raise _bad(path, number, 'a header line (template, fewshot) may only be the first line.')
      header, header_line = _header(record, path, number), number
      continue
    line_kind, fields = _example(record, path, number)
    if kind is not None and line_kind != kind:
      raise _bad(path, number, f'a {line_kind} line in a {kind} file; keep one kind of question a file.')
    kind = line_kind
    questions.append((number, fields))
  if not questions:
    raise UserError(f'eval task file {path} holds no questions; give one JSON object a line (docs/evals.md).')
  header = header or _header({}, path)
  shots = []
  for example in header['fewshot']:
    shot_kind, shot = _example(example, path, header_line)
    target = shot['choices'][shot['gold']] if shot_kind == 'multiple_choice' else shot['answer']
    shots.append(_shown(header, shot['context']) + header['target_delimiter'] + target)
  prefix = ''.join(s + header['fewshot_delimiter'] for s in shots)
  if max_questions > 0:
    questions = questions[:max_questions]
  built = []
  for number, q in questions:
    prompt = prefix + _shown(header, q['context'])
    if kind == 'multiple_choice':
      built.append(Question(prompt, tuple(header['target_delimiter'] + c for c in q['choices']),
                            tuple(len(c) for c in q['choices']), q['gold'], line=number))
    else:  # As lm-eval's generate_until: the prompt without a delimiter; the text is compared stripped.
      built.append(Question(prompt, (), (), -1, q['answer'], q['stop'], line=number))
  return TaskFile(p.stem, str(path), kind, tuple(built))
