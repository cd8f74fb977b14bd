"""A Hugging Face chat template rendered as transformers' apply_chat_template renders it, without transformers.

A published template is Jinja written against transformers' environment, not
plain Jinja's: Llama 3.1/3.2 call `strftime_now` for their "Today Date" (and fall
back to a fixed "26 Jul 2024" where it is missing, so plain Jinja silently
renders another text than a server does); Llama's tool prompts call `tojson`
with `indent`; Qwen3 keeps state in a `namespace`; some templates `break` out of
loops or mark assistant text with `{% generation %}`. This module gives a
template what transformers 5 gives it (utils/chat_template_utils.py:
`_cached_compile_jinja_template`, `render_jinja_template`): the same sandboxed
environment and options, the same globals and filter, the same variables
(`messages`, `tools` and `documents` as None, `add_generation_prompt`, the
tokenizer's named special tokens, then any extra keyword), and the messages
cleaned the same way (keys whose value is None dropped; `reasoning_content` filled
from `thinking` or `reasoning`). tests/test_chat_templates.py compares it with
transformers itself on the published Llama 3.2, Mistral v0.3, Qwen2.5 and Qwen3
templates.
"""

import datetime
import functools
import json

from trainer.base.errors import UserError

# The named special tokens transformers passes to a template (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token', 'mask_token')
# Names a message's reasoning comes under; templates read the first (transformers' _REASONING_FIELDS).
REASONING_FIELDS = ('reasoning_content', 'thinking', 'reasoning')


def strftime_now(format_: str) -> str:
  """Today's date or time as the template asks for it, local time, as transformers' `strftime_now`."""
  return datetime.datetime.now().strftime(format_)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  """transformers' `tojson` filter: json.dumps with its options, no HTML escaping (Jinja's own escapes '<')."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
  raise UserError(f'the chat template refused the conversation: {message}')


def special_tokens(config: dict) -> dict[str, str]:
  """tokenizer_config.json's named special tokens as a template sees them (a token object by its content)."""
  found = {k: config.get(k) for k in SPECIAL_TOKENS}
  found = {k: (v.get('content') if isinstance(v, dict) else v) for k, v in found.items()}
  return {k: str(v) for k, v in found.items() if v is not None}


def clean_messages(messages: list[dict]) -> list[dict]:
  """Messages as transformers hands them to a template: None values dropped, reasoning under each of its names."""
  cleaned = []
  for message in messages:
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {'thinking': reasoning, **message, 'reasoning_content': reasoning}
    cleaned.append(message)
  return cleaned


@functools.lru_cache(maxsize=8)  # One template renders every line of a file: compiled once.
def _compiled(template: str):
  import jinja2.ext
  import jinja2.sandbox

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers tracks assistant text with it; rendered as its body."""
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(['name:endgeneration'], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = _raise_exception
  env.globals['strftime_now'] = strftime_now
  return env.from_string(template)


def render(template: str, messages: list[dict], add_generation_prompt: bool, config: dict, **kwargs) -> str:
  """`messages` rendered by `template` as apply_chat_template(tokenize=False) renders them with a tokenizer whose
  tokenizer_config.json is `config`; `kwargs` are the template's extra variables (e.g. enable_thinking=False)."""
  import jinja2
  try:
    return _compiled(template).render(messages=clean_messages(messages), tools=None, documents=None,
                           add_generation_prompt=add_generation_prompt, **{**special_tokens(config), **kwargs})
  except jinja2.TemplateError as e:
    raise UserError(f'the chat template cannot render the conversation ({type(e).__name__}: {e}).') from None
