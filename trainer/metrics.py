"""Where metrics go: WORKDIR/metrics.jsonl, TensorBoard event files and a progress line.

Only process 0 writes; on other processes every method is a no-op, so the loop
never branches on the process index.
"""

import json
import pathlib

import tensorboardX
from absl import logging


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  return f'{hours}h{rest // 60:02d}m{rest % 60:02d}s' if hours else f'{rest // 60}m{rest % 60:02d}s'


class MetricsWriter:
  """One JSON object per logged step, the same scalars in TensorBoard, and a human progress line."""

  def __init__(self, workdir: str, enabled: bool, total_steps: int):
    self._enabled = enabled
    self._total_steps = total_steps
    if enabled:
      workdir = pathlib.Path(workdir)
      workdir.mkdir(parents=True, exist_ok=True)
      self._jsonl = (workdir / 'metrics.jsonl').open('a')
      self._tb = tensorboardX.SummaryWriter(str(workdir / 'tensorboard'))

  def write(self, step: int, scalars: dict[str, float]) -> None:
    """Records one logged step; keys with an 'eval_' prefix go under eval/ in TensorBoard."""
    if not self._enabled:
      return
    record = {'step': step, **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    for key, value in record.items():
      if key != 'step':
        tag = f'eval/{key[len("eval_"):]}' if key.startswith('eval_') else f'train/{key}'
        self._tb.add_scalar(tag, value, step)
    self._tb.flush()
    self._progress(record)

  def _progress(self, record: dict[str, float]) -> None:
    step = record['step']
    parts = [f'step {step}/{self._total_steps}']
    if 'loss' in record:
      parts.append(f'loss {record["loss"]:.4f}')
    if 'eval_loss' in record:
      parts.append(f'eval_loss {record["eval_loss"]:.4f}')
    if 'tokens_per_s' in record:
      parts.append(f'{record["tokens_per_s"]:,.0f} tok/s')
    if 'step_time_s' in record:
      parts.append(f'ETA {_duration(record["step_time_s"] * (self._total_steps - step))}')
    logging.info(' | '.join(parts))

  def write_text(self, tag: str, text: str) -> None:
    if self._enabled:
      self._tb.add_text(tag, text, 0)

  def close(self) -> None:
    if self._enabled:
      self._jsonl.close()
      self._tb.close()
