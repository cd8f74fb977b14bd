"""Where metrics go: WORKDIR/metrics.jsonl, TensorBoard event files, a progress line and bar, the goodput.

Only process 0 writes; on other processes every method is a no-op, so the loop
never branches on the process index. In a bucket (gs://) both files are
rewritten whole at each flush, so they are flushed every
storage.CLOUD_FLUSH_EVERY_S seconds and at close rather than at every record,
from threads of their own (storage.AppendLog's and tensorboardX's), never from
the step loop's.

Every numeric key of a logged record reaches both metrics.jsonl and TensorBoard
(keys starting 'eval_' under eval/, the rest under train/), so a new scalar in
the loop's summary needs no change here. Device memory in use and at peak is
added where the backend reports it (GPU, TPU); the CPU backend reports none,
which is said once in the log instead of logging zeros.
"""

import json
import secrets
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tensorboardX
from absl import logging
from tensorboardX import summary as tb_summary

from trainer.base import storage
from trainer.observe import goodput as goodput_lib
from trainer.observe import progress
from trainer.observe import trackers as trackers_lib
from trainer.observe.trackers import hparams

_GIB = 2**30
# Events tensorboardX may hold for its writer thread in a bucket: ~20 scalars per logged step, many steps per upload.
TB_CLOUD_QUEUE = 10_000


def device_memory_scalars(memory_stats: Sequence[dict[str, Any] | None]) -> dict[str, float] | None:
  """Memory in use and at peak, in GiB, of the fullest local device; None if no device reports any.

  `memory_stats` is `[d.memory_stats() for d in jax.local_devices()]`. The
  fullest device is the one that runs out first, so it is the one to watch.
  """
  stats = [s for s in memory_stats if s and 'bytes_in_use' in s]
  if not stats:
    return None
  scalars = {'device_memory_in_use_gib': max(s['bytes_in_use'] for s in stats) / _GIB}
  if any('peak_bytes_in_use' in s for s in stats):
    scalars['device_memory_peak_gib'] = max(s.get('peak_bytes_in_use', 0) for s in stats) / _GIB
  if any('bytes_limit' in s for s in stats):
    scalars['device_memory_limit_gib'] = min(s['bytes_limit'] for s in stats if 'bytes_limit' in s) / _GIB
  return scalars


def _tag(key: str) -> str:
  return f'eval/{key[len("eval_"):]}' if key.startswith('eval_') else f'train/{key}'


class MetricsWriter:
  """One JSON object per logged step, the same scalars in TensorBoard, and a human progress line."""

  def __init__(self, workdir: str, enabled: bool, total_steps: int, progress_bar: str = 'off',
               goodput: goodput_lib.Goodput | None = None, trackers: 'trackers_lib.Trackers | None' = None):
    self._enabled = enabled
    # log.trackers (trainer/observe/trackers/): copies of every record, off the step's thread.
    self._trackers = trackers
    self._total_steps = total_steps
    self.goodput = goodput
    self._bar = progress.ProgressBar(total_steps, progress_bar if enabled else 'off')
    self._memory_reported = None  # Whether the backend reports device memory; asked once.
    self._last_step = 0
    # The first logged step of an attempt times one step that pays first-run costs (a restore's first reads, the
    # executable's first run): an ETA from it said 20 minutes for a resumed run's 40 seconds. Later lines average
    # a window of steps.
    self._eta_ready = False
    self._workdir = storage.path(workdir)
    self._cloud = storage.is_cloud(self._workdir)
    if enabled:
      self._jsonl = storage.AppendLog(self._workdir / 'metrics.jsonl')
      # In a bucket each flush uploads the whole event file, so only tensorboardX's own writer thread flushes, every
      # CLOUD_FLUSH_EVERY_S; its queue holds many logged steps, so add_scalar never waits for an upload under way
      # (tests/test_gcs.py holds one back). On disk a flush is cheap: every logged step.
      self._tb = tensorboardX.SummaryWriter(
          str(self._workdir / 'tensorboard'), max_queue=TB_CLOUD_QUEUE if self._cloud else 10,
          flush_secs=storage.CLOUD_FLUSH_EVERY_S if self._cloud else 120,
          # tensorboardX opens its file itself, following a link: a name nobody can guess is never planted.
          filename_suffix=f'.{secrets.token_hex(8)}')

  def step_done(self, step: int, loss: float, step_time_s: float, data_wait_s: float, tokens_per_step: int) -> None:
    """Every step, as its metrics arrive: feeds the goodput and the progress bar."""
    if self.goodput is not None:
      self.goodput.record_step(step_time_s, data_wait_s)
    if self._enabled:
      self._bar.update(step, loss, step_time_s, tokens_per_step)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    """Records one logged step; keys with an 'eval_' prefix go under eval/ in TensorBoard."""
    if not self._enabled:
      return
    extra = self.goodput.take_window() if self.goodput is not None else {}
    # None means "not known here" (e.g. MFU on an unknown accelerator): left out rather than logged as a number.
    record = {'step': step, **{k: float(v) for k, v in {**scalars, **extra, **self._memory()}.items()
                               if v is not None}}
    self._jsonl.write(json.dumps(record) + '\n')
    if self._trackers is not None:
      self._trackers.log(step, record)
    for key, value in record.items():
      if key != 'step':
        self._tb.add_scalar(_tag(key), value, step)
    if not self._cloud:
      self._tb.flush()
    self._last_step = step
    self._progress(record)

  def write_histograms(self, step: int, vectors: dict) -> None:
    """TensorBoard histograms of vector metrics (an MoE layer's load per expert); metrics.jsonl keeps scalars only."""
    if self._enabled:
      for key, values in vectors.items():
        self._tb.add_histogram(_tag(key), np.asarray(values), step)

  def _memory(self) -> dict[str, float]:
    if self._memory_reported is False:
      return {}
    scalars = device_memory_scalars([d.memory_stats() for d in jax.local_devices()])
    if self._memory_reported is None and scalars is None:
      logging.info('Device memory: the %s backend reports no memory statistics; device_memory_* is not logged.',
                   jax.default_backend())
    self._memory_reported = scalars is not None
    return scalars or {}

  def _progress(self, record: dict[str, float]) -> None:
    step = record['step']
    parts = [f'step {step}/{self._total_steps}']
    if 'loss' in record:
      parts.append(f'loss {record["loss"]:.4f}')
    if 'accuracy' in record:
      parts.append(f'accuracy {record["accuracy"]:.3f}')
    if 'epochs' in record:
      parts.append(f'epoch {record["epochs"]:.2f}')
    if 'eval_loss' in record:
      parts.append(f'eval_loss {record["eval_loss"]:.4f}')
    if 'eval_accuracy' in record:
      parts.append(f'eval_accuracy {record["eval_accuracy"]:.3f}')
    if 'tokens_per_s' in record:
      parts.append(f'{record["tokens_per_s"]:,.0f} tok/s')
    if 'images_per_s' in record:
      parts.append(f'{record["images_per_s"]:,.0f} images/s')
    if 'tflops_per_device' in record:
      parts.append(f'{record["tflops_per_device"]:.3g} TFLOP/s/device')
    if 'mfu' in record:
      parts.append(f'MFU {record["mfu"]:.1%}')
    for mode in ('fp8', 'int8'):  # train.quantization: against the peak each dot runs at.
      if f'mfu_{mode}' in record:
        parts.append(f'MFU {record[f"mfu_{mode}"]:.1%} of the {mode} peak')
    if 'step_time_s' in record and self._eta_ready:
      parts.append(f'ETA {progress.duration(record["step_time_s"] * (self._total_steps - step))}')
    self._eta_ready = self._eta_ready or 'step_time_s' in record
    logging.info(' | '.join(parts))

  def write_text(self, tag: str, text: str) -> None:
    if self._enabled:
      self._tb.add_text(tag, text, 0)

  def write_config(self, config) -> None:
    """The resolved config: as text, and as hparams (TensorBoard's HParams tab) against the run's losses."""
    if not self._enabled:
      return
    self.write_text('config', f'```\n{config}\n```')
    if self._trackers is not None:
      self._trackers.start(config.to_dict(), str(config))
    metrics = {'train/loss': 0.0, 'eval/loss': 0.0}  # Declared only: the plugin reads these runs' scalars.
    for event in tb_summary.hparams(hparams.flat(config.to_dict()), metrics):
      self._tb.file_writer.add_summary(event)
    self._tb.flush()

  def close(self) -> None:
    self._bar.close()
    if self._enabled and self.goodput is not None and self.goodput.steps:
      self._write_goodput()
    if self._trackers is not None:
      self._trackers.close()
    if self._enabled:
      self._jsonl.close()
      try:
        self._tb.close()
      except Exception as e:
        if not (self._cloud and getattr(e, 'code', None) in (404, 412)):  # Its object or the bucket gone (issue 54).
          raise
        raise storage.objects_gone(self._workdir, 'TensorBoard\'s event file') from None

  def _write_goodput(self) -> None:
    """Printed, added to TensorBoard (goodput/* at the last step, and as text) and appended to goodput.jsonl."""
    summary = self.goodput.summary()
    table = goodput_lib.format_summary(summary)
    logging.info('%s', table)
    for key, value in summary.items():
      self._tb.add_scalar(f'goodput/{key}', value, self._last_step)
    self._tb.add_text('goodput', f'```\n{table}\n```', self._last_step)
    if self._trackers is not None:
      self._trackers.goodput(self._last_step, summary, table)
    log = storage.AppendLog(self._workdir / 'goodput.jsonl')
    log.write(json.dumps({'step': self._last_step, **summary}) + '\n')
    log.close()
