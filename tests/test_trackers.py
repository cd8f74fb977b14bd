"""log.trackers: Weights & Biases (offline) and MLflow (a local folder) get metrics.jsonl's records, read back here
through each library's own formats; an unreachable tracker warns once and the run finishes."""

import json
import logging
import socket
import struct

import jax
import pytest

from conftest import read_metrics
from configs import tiny
from trainer.base.errors import UserError
from trainer.observe import trackers
from trainer.run import loop
from test_strategies import TEXT_DIR


def _config(tmp_path, **log):
  c = tiny.get_config()
  c.data.text_dir = str(TEXT_DIR)
  c.train.steps = 4
  c.ckpt.every_steps = 4
  c.log.every_steps = 2
  c.log.run_name = 'tracked-run'
  for key, value in log.items():
    c.log[key] = value
  return c


def _wandb_records(workdir):
  """Every record of the offline run's transaction log (run-ID.wandb), parsed with wandb's own protobuf messages.

  wandb 0.31 ships no Python reader of the file (wandb-core, in Go, reads it); its framing is LevelDB's log format
  after a 7-byte ':W&B' header: 32 KiB blocks of records, each a 7-byte header (crc32, length, type) and its bytes,
  a record cut across blocks as FIRST, MIDDLE..., LAST pieces.
  """
  from wandb.proto import wandb_internal_pb2
  (path,) = list((workdir / 'wandb').glob('offline-run-*/run-*.wandb'))
  data, block = path.read_bytes(), 32768
  assert data[:4] == b':W&B'
  pos, pieces, records = 7, b'', []
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:
      pos += left
      continue
    _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
    if length == 0 and kind == 0:  # Zero padding to the block's end.
      pos += left
      continue
    pieces += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # FULL or LAST.
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pieces)
      records.append(record)
      pieces = b''
  return records


def _goodput(workdir) -> dict:
  return json.loads((workdir / 'goodput.jsonl').read_text().splitlines()[-1])


def _expected(workdir) -> dict[str, dict[int, float]]:
  """metrics.jsonl as {TensorBoard tag: {step: value}}."""
  expected = {}
  for record in read_metrics(workdir):
    for key, value in record.items():
      if key != 'step':
        expected.setdefault(trackers.tag(key), {})[record['step']] = value
  return expected


def test_wandb_offline_and_mlflow_folder_hold_metrics_jsonl(tmp_path):
  from mlflow.tracking import MlflowClient
  workdir = tmp_path / 'tracked-run'
  mlruns = tmp_path / 'mlruns'
  config = _config(tmp_path, trackers=('wandb', 'mlflow'), wandb_mode='offline', mlflow_tracking_uri=str(mlruns))
  loop.run(config, str(workdir), devices=jax.devices()[:2])
  expected = _expected(workdir)
  assert {'train/loss', 'eval/loss', 'train/tokens_per_s'} <= set(expected) and expected['train/loss'].keys() == {1, 2, 4}

  records = _wandb_records(workdir)
  history = {}
  for r in records:
    if r.WhichOneof('record_type') == 'history':
      # wandb keeps a name with '/' as its parts (nested_key).
      items = {i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
      for key, value in items.items():
        if not key.startswith('_'):
          history.setdefault(key, {})[items.get('_step', r.history.step.num)] = value
  assert history.keys() == expected.keys()
  for key in expected:
    assert history[key] == pytest.approx(expected[key], rel=1e-12), key
  (run,) = [r.run for r in records if r.WhichOneof('record_type') == 'run']
  assert run.display_name == 'tracked-run'
  config_items = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof('record_type') == 'run'
                  for i in r.run.config.update}
  assert config_items['train']['steps'] == 4
  summary = {i.key or '/'.join(i.nested_key): i.value_json for r in records if r.WhichOneof('record_type') == 'summary' for i in r.summary.update}
  assert json.loads(summary['goodput/goodput']) == pytest.approx(_goodput(workdir)['goodput'], rel=1e-12)
  assert 'Goodput' in json.loads(summary['goodput/table'])

  client = MlflowClient(tracking_uri=str(mlruns))
  (found,) = client.search_runs([client.get_experiment_by_name('jax-launch').experiment_id])
  assert found.info.run_name == 'tracked-run' and found.info.status == 'FINISHED'
  assert found.data.params['train.steps'] == '4' and found.data.params['log.trackers'] == "('wandb', 'mlflow')"
  for key, by_step in expected.items():
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}
    assert history == pytest.approx(by_step, rel=1e-12), key
  assert found.data.metrics['goodput/goodput'] == pytest.approx(_goodput(workdir)['goodput'], rel=1e-12)
  assert 'Goodput' in (mlruns / found.info.experiment_id / found.info.run_id / 'artifacts' / 'goodput.txt').read_text()


def _silent_server():
  """A port that accepts connections and never answers: a tracking server that hangs."""
  server = socket.socket()
  server.bind(('127.0.0.1', 0))
  server.listen(16)
  return server


@pytest.mark.parametrize('case', ['refused', 'hangs'])
def test_an_unreachable_tracker_warns_once_and_the_run_finishes(tmp_path, monkeypatch, caplog, case):
  server = _silent_server()
  port = server.getsockname()[1]
  if case == 'refused':
    server.close()  # Nothing listens: every request is refused, and MLflow gives up after no retries.
    monkeypatch.setenv('MLFLOW_HTTP_REQUEST_MAX_RETRIES', '0')
  workdir = tmp_path / 'run'
  config = _config(tmp_path, trackers=('mlflow',), mlflow_tracking_uri=f'http://127.0.0.1:{port}',
                   tracker_close_timeout_s=3.0)
  with caplog.at_level(logging.WARNING):
    loop.run(config, str(workdir), devices=jax.devices()[:2])
  server.close()
  warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Tracker mlflow:')]
  assert len(warnings) == 1, warnings
  assert ('could not start' if case == 'refused' else 'not done 3s after the run ended') in warnings[0]
  assert [r['step'] for r in read_metrics(workdir)] == [1, 2, 4]


def test_trackers_are_checked_before_the_run_and_off_outside_process_0(tmp_path):
  c = tiny.get_config()
  c.log.trackers = ('wandb', 'neptune')
  with pytest.raises(UserError, match=r"log.trackers=\('wandb', 'neptune'\): unknown \['neptune'\]"):
    trackers.build(c.log, str(tmp_path), enabled=True)
  c.log.trackers = ('mlflow',)
  off = trackers.build(c.log, str(tmp_path), enabled=False)
  off.start({}, '')
  off.log(1, {'loss': 1.0})
  off.close()
  assert not list(tmp_path.iterdir())
