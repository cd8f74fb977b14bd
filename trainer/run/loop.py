"""The run: build everything once from the config, then train, evaluate, log and checkpoint.

Host-device sync is deliberate: each iteration dispatches step k, then fetches
step k-1's metrics, so the device always has the next step queued while the host
logs, and never more than two steps are in flight.
"""

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from parallel import param_names, sharding
from trainer import data, pipeline
from trainer import evals as evals_lib
from trainer.base import confined, storage
from trainer.hf import load as hf_load
from trainer.memory import runtime_oom
from trainer.models import contract, lora, moe
from trainer.observe import expert_load, flops, profiling, progress
from trainer.observe import goodput as goodput_lib
from trainer.observe import trackers as trackers_lib
from trainer.observe.metrics import MetricsWriter
from trainer.run import compilation_cache, evaluation, preflight
from trainer.run import job as job_lib
from trainer.safety import guardrails, preemption, startup_signals
from trainer.supervision import attempt, elastic, faults, hang, notices, stragglers
from trainer.training import checkpoint, local_tier, objectives, optimizer, resume
from trainer.training import manifest as manifests


# Step metrics the window summarizes itself, or that are for the guardrails only.
NOT_LOGGED = ('loss', 'grads_finite', 'learning_rate', 'grad_norm', 'param_norm')


@dataclasses.dataclass
class Window:
  """Per-step host measurements accumulated between two log lines."""
  losses: list[float] = dataclasses.field(default_factory=list)
  step_times: list[float] = dataclasses.field(default_factory=list)
  data_waits: list[float] = dataclasses.field(default_factory=list)
  device_waits: list[float] = dataclasses.field(default_factory=list)  # Blocked on the devices (see stragglers.py).
  # The first window after a start, resume or rollback includes the input threads starting: never a stall.
  first: bool = False

  def summary(self, last_metrics: dict[str, float], units_per_step: int, unit: str = 'tokens',
              throughput: flops.Throughput | None = None) -> dict[str, float]:
    step_time = float(np.mean(self.step_times))
    return {**(throughput.metrics(step_time) if throughput else {}),
        # The task's own metrics (z_loss, accuracy, ...), as of the window's last step.
        **{k: float(v) for k, v in last_metrics.items() if k not in NOT_LOGGED and np.ndim(v) == 0},
        'loss': float(np.mean(self.losses)),
        'learning_rate': last_metrics['learning_rate'],
        'grad_norm': last_metrics['grad_norm'],
        'step_time_s': step_time,
        f'{unit}_per_s': units_per_step / step_time,
        'data_wait_s': float(np.mean(self.data_waits)),
        'param_norm': last_metrics['param_norm'],
    }


@dataclasses.dataclass(frozen=True)
class RunContext:
  """What stays fixed while a run trains: the compiled step, data, checkpointer, writers and watchers."""
  config: Any
  objective: objectives.Objective
  compiled_step: Any  # `(state, global batch) -> (state, metrics)`, compiled once.
  eval_step: Any
  eval_set: list  # Fixed held-out global batches; empty = no eval.
  train_iter: data.DeviceFeed  # Global batches already on the batch shardings (the Job's).
  ckpt: checkpoint.Checkpointer
  manifest: dict
  writer: MetricsWriter
  guard: guardrails.Guard
  preempt: preemption.PreemptionWatch
  throughput: flops.Throughput | None  # None where the step cannot be traced for its FLOPs (trainer/observe/flops.py).
  profiler: profiling.Profiler
  # The run's watchers (trainer/supervision/); inert by default, for callers that drive `_train` themselves.
  hang: 'hang.HangWatch' = dataclasses.field(default_factory=lambda: hang.HangWatch(0, '', 0))
  fault: 'faults.Fault | None' = None  # A test's injected fault (trainer/supervision/faults.py); None in real runs.
  stragglers: 'stragglers.StragglerWatch' = dataclasses.field(
      default_factory=lambda: stragglers.StragglerWatch(0, 1, 1.0))
  notices: 'notices.Notices' = dataclasses.field(default_factory=lambda: notices.Notices((), None))
  examples_per_epoch: int | None = None  # Global training examples in one pass; None where the source has no end.
  idle_experts: expert_load.IdleExperts = dataclasses.field(default_factory=lambda: expert_load.IdleExperts(0))
  downstream: 'evals_lib.Downstream | None' = None  # eval.tasks, scored on the training mesh (trainer/evals/).
  sources: 'data.mixture.Accounting | None' = None  # data.source='mixture': tokens seen and eval loss per source.
  first_log: dict = dataclasses.field(default_factory=dict)  # Scalars of an attempt's first logged step (its size).
  local: 'local_tier.LocalTier | None' = None  # ckpt.local_dir: the per-host tier (trainer/training/local_tier.py).


def run(config, workdir: str, devices: Sequence[jax.Device] | None = None, start_over: bool = False,
        elastic_size: elastic.Size | None = None) -> None:
  """Trains `config` in `workdir`, resuming from its newest checkpoint if there is one.

  `devices` (default: every device of every process) is what the mesh is built
  over; tests pass a subset to run the same job on fewer devices. `elastic_size`: the size of an elastic run's
  attempt (trainer/supervision/elastic.py, already applied to `config`), logged as scalars and in the goodput.
  """
  hang_watch = hang.HangWatch(config.train.hang_timeout_s, workdir, jax.process_index()).start()
  try:
    _run(config, workdir, devices, start_over, hang_watch, elastic_size)
  finally:
    hang_watch.close()


def _run(config, workdir: str, devices, start_over: bool, hang_watch: hang.HangWatch,
         elastic_size: elastic.Size | None = None) -> None:
  compilation_cache.enable(config.train.compilation_cache_dir)
  config = hf_load.configure(config)  # model.init_from: config.json's model keys (weights come at init_state).
  # Building the Job makes remat 'auto' a concrete policy; a resumed run reads its earlier choice back.
  job = job_lib.build_job(config, devices, workdir=None if start_over else workdir)
  config = job.config
  profiling.check_config(config.profile)
  progress.check_mode(config.log.progress_bar)
  mesh, abstract, shardings = job.mesh, job.abstract, job.shardings
  objective = job.task.objective
  process_index, process_count = jax.process_index(), jax.process_count()

  logging.info('Reading the data ...')  # Listing and packing a text folder takes seconds; say what is under way.
  t_data = time.perf_counter()
  needs = data.Needs.of(config.model, config.train)  # The few model and train settings the input side reads.
  inputs = data.build(config.data, needs, job.batch_shardings, process_index, process_count)
  # Global batches reach the devices while the step before them runs; checkpointed by what steps consumed.
  host_batches = faults.slow_reads(faults.for_process(process_index), inputs.train, config.train.batch_size)
  train_iter, eval_set = data.DeviceFeed(host_batches, job.batch_shardings, process_count), inputs.eval_batches
  logging.info('Data: %s (read in %.1fs)', inputs.description, time.perf_counter() - t_data)
  downstream = evals_lib.build(config.eval, job, workdir) if 'eval' in config else None  # Task files checked now.
  trackers = trackers_lib.build(config.log, workdir, enabled=process_index == 0)  # log.trackers checked now.
  manifest = {**manifests.run_manifest(config, abstract, mesh), 'memory': job.memory.record()}
  # Before compiling: a foreign or unreadable workdir should fail in seconds, not minutes. (Only damaged steps are
  # moved aside here, and kept; intact checkpoints are only read.)
  ckpt = None if start_over else checkpoint.Checkpointer(workdir, config.ckpt)
  local = local_tier.LocalTier(config.ckpt.local_dir, config.ckpt.local_every_steps, workdir, process_index,
                               process_count)
  # Either tier's step is checked against this launch the same way (trainer/training/resume.py).
  resumable, found, not_local = ([], None, '') if start_over else resume.choose(
      ckpt, local, manifest, sharding.with_shardings(abstract, shardings), workdir)
  # Before the compile: a finished run has nothing to build. Finished only if its final checkpoint restores (a
  # restore costs far less than the compile); a damaged one falls through to the usual fallback and trains again.
  if (resumable and resumable[0] >= config.train.steps
      and ckpt.restores(resumable[0], sharding.with_shardings(abstract, shardings))):
    logging.info('Checkpoint step %d in %s already reaches train.steps=%d: nothing to train (raise '
                 '--config.train.steps to train further).', resumable[0], ckpt.directory, config.train.steps)
    train_iter.close()
    ckpt.close()
    # An attempt that died in the final eval left none: said once, in one line (evaluation.py).
    evaluation.check_finished_run(workdir, resumable[0], bool(eval_set) or downstream is not None,
                                  write=process_index == 0)
    return
  if config.model.init_from and not resumable:
    hf_load.check_weights(config, lora.base(job.abstract.params))  # Headers only: a wrong folder fails before the compile.
  if (not resumable and job.brought_model and objective.kind == 'lm' and not job.task.custom_loss
      and config.model.check_alignment):
    contract.check_alignment(job, config.train.seed)  # Seconds, and before the long compile.
  # Compiled and checked against device memory before anything else touches the workdir: a refused launch, with
  # --start_over too, changes nothing.
  logging.info('Compiling the train step (tracing, compiling, then the pre-flight memory check; seconds to minutes, '
               'printing nothing until done) ...')
  start = time.perf_counter()
  hang_watch.phase('compile')
  compiled_step = preflight.compile_checked(job)
  compile_s = time.perf_counter() - start
  logging.info('Compiled the train step in %.1fs', compile_s)
  if start_over:  # Only once the config, data and memory were checked: a launch that fails early moves nothing.
    checkpoint.start_over(workdir)
    ckpt = checkpoint.Checkpointer(workdir, config.ckpt)
    local.set_aside()
  _describe(job, workdir, write=process_index == 0)

  tracker = goodput_lib.Goodput(workdir, resumed_step=found.step if found else resumable[0] if resumable else None,
                                shrunk=bool(elastic_size and elastic_size.shrunk))
  tracker.compiled(compile_s)

  latest = None
  hang_watch.phase('restore')
  t_state = time.perf_counter()
  if found:
    latest, state = found.step, resume.restore_local(local, found, sharding.with_shardings(abstract, shardings),
                                                     train_iter, resumable[0] if resumable else None)
  elif resumable:
    if not_local:
      logging.info('Restoring from the persistent tier (%s): %s.', ckpt.directory, not_local)
    logging.info('Restoring checkpoint step %d from %s ...', resumable[0], ckpt.directory)
    latest, state = ckpt.restore_newest_intact(resumable, sharding.with_shardings(abstract, shardings), train_iter)
    logging.info('Resuming from checkpoint at step %d in %s (data iterator position restored) after %.1fs',
                 latest, ckpt.directory, time.perf_counter() - t_state)
    if config.model.init_from:
      logging.info('model.init_from=%r is not read: a resumed run continues from its checkpoint\'s weights.',
                   config.model.init_from)
  else:
    if not_local:
      logging.info('Training from step 0: %s, and the persistent tier (%s) has none.', not_local, ckpt.directory)
    logging.info('Initializing the parameters (compiling the init) ...')
    state = job.init_state(config.train.seed)
    logging.info('Initialized the parameters in %.1fs', time.perf_counter() - t_state)

  attempt.note(process_index=process_index, resumed_step=latest or 0, steps_redone=tracker.lost_steps,
               resumed_from='local tier' if found else 'persistent tier' if latest else 'start',
               # With the local tier's files, read before the compile as its step was chosen.
               restore_s=round(time.perf_counter() - t_state + local.read_s, 3))
  local.discard_after(latest or 0)
  writer = MetricsWriter(workdir, enabled=process_index == 0, total_steps=config.train.steps,
                         progress_bar=config.log.progress_bar, goodput=tracker, trackers=trackers)
  if process_index == 0:
    confined.write_text(storage.path(workdir) / 'config.json', config.to_json_best_effort(indent=2))
    writer.write_config(config)
  guard = guardrails.Guard(config.train.on_nonfinite, list(manifest['param_shapes']),
                           guardrails.packing_hint(config.data) if config.model.task == 'lm' else '',
                           resumed_step=latest)
  preempt = preemption.PreemptionWatch()
  notice = notices.Notices(tuple(config.train.preemption_signals), config.train.preemption_notice_file)
  profiler = profiling.Profiler(config.profile, workdir, first_step=(latest or 0) + 1, total_steps=config.train.steps,
                                goodput=tracker)
  run_context = RunContext(
      config=config, objective=objective, compiled_step=compiled_step, eval_step=job.eval_step, eval_set=eval_set,
      train_iter=train_iter, ckpt=ckpt,
      manifest=manifest, writer=writer, guard=guard, preempt=preempt,
      throughput=flops.Throughput.for_job(job), profiler=profiler, hang=hang_watch,
      fault=faults.for_process(process_index),
      examples_per_epoch=getattr(inputs.train, 'examples_per_epoch', None),
      notices=notice, stragglers=stragglers.StragglerWatch(process_index, process_count, config.train.straggler_warn_fraction),
      idle_experts=expert_load.IdleExperts(config.log.get('idle_expert_steps', 0)), downstream=downstream,
      sources=data.accounting(config.data, needs, inputs), local=local,
      first_log={} if elastic_size is None else {'processes': elastic_size.processes,
                                                 'grad_accum_steps': elastic_size.grad_accum_steps})
  try:
    while True:
      try:
        _train(run_context, state, start_step=latest or 0)
        break
      except guardrails.Rollback as rollback:
        latest, state = guard.roll_back(rollback, ckpt, sharding.with_shardings(abstract, shardings), train_iter)
        local.discard_after(latest)
  except Exception as e:
    profiler.on_error(e)  # Out of memory: saves the device memory profile while the arrays are still alive.
    raise runtime_oom.explain(e, compiled_step, config.train, list(mesh.devices.flat)) or e  # OOM: one line, exit 2.
  finally:
    train_iter.close()
    profiler.close()
    notice.close()
    t_close = time.perf_counter()
    try:
      local.wait_until_finished()
      ckpt.close()  # Waits for an async save in flight: a finished run never leaves a half-written checkpoint.
    finally:
      preempt.close()  # After the final save: a signal during it is answered below, once the save is complete.
    tracker.record_side(checkpoint_s=time.perf_counter() - t_close)
    writer.close()
  late = preempt.unanswered()
  if late is not None:
    raise startup_signals.OutsideTheLoop(late, f'It came during the final eval or save, which finished: the newest '
                                               f'checkpoint is step {ckpt.latest_step()} in {ckpt.directory}.')


def _active_params(config, num_params: int) -> str:
  """' (N active per token)' for the built-in MoE Llama, whose tokens each run experts_per_token experts."""
  inactive = moe.inactive_params(config.model) if config.model.name == 'llama' else 0
  return f' ({num_params - inactive:,} active per token)' if inactive else ''


def _describe(job: job_lib.Job, workdir: str, write: bool) -> None:
  """Logs the mesh and model and a one-line sharding summary; process 0 writes the table to WORKDIR/sharding.txt."""
  config, mesh = job.config, job.mesh
  num_params = sum(x.size for x in jax.tree.leaves(job.abstract.params))
  logging.info('Mesh %s over %d devices (%d processes); model: %s (%s, %s), %s parameters%s', dict(mesh.shape),
               mesh.size, jax.process_count(), config.model.name, job.task.model.framework, config.model.task,
               f'{num_params:,}', _active_params(config, num_params))
  logging.info('%s', optimizer.describe(config.train))
  if stages := pipeline.summary(config.model, config.train, dict(mesh.shape)):
    logging.info('%s', stages)
  table, totals = sharding.sharding_table(job.abstract, job.shardings, job.task.param_notes,
                                          optimizer.decaying_params(job.config.train, job.task.model.abstract_boxed))
  note = param_names.unsplit_note(job.task.model.abstract_boxed, job.shardings.params, dict(mesh.shape),
                                  job.task.param_notes, config.model.name)
  if note and write:
    logging.warning('%s', note)
  if write:  # The table is a line per parameter: the console gets one line, the file all of them.
    storage.path(workdir).mkdir(parents=True, exist_ok=True)
    confined.write_text(storage.path(workdir) / 'sharding.txt', table + '\n')
    logging.info('Sharding: %s; the table per parameter is in %s/sharding.txt',
                 sharding.summary(job.abstract, job.shardings, totals), workdir)


def _train(run: 'RunContext', state, start_step: int) -> None:
  config, ckpt, guard, preempt, profiler, train_iter = (run.config, run.ckpt, run.guard, run.preempt, run.profiler,
                                                        run.train_iter)
  total = config.train.steps
  if start_step >= total:
    logging.info('Checkpoint step %d already reaches train.steps=%d: nothing to train.', start_step, total)
    return

  def is_log_step(s):
    return s == start_step + 1 or s % config.log.every_steps == 0 or s == total or s in evals

  window, evals, pending, failed = Window(first=True), {}, None, None
  # Waits measured since the last fetch: they lie inside the step time that fetch closes, so a window's wait is a
  # part of its step time (pairing a step with its own batch's wait, taken a fetch earlier, gave shares over 100%).
  last_fetch, side_time, waited = time.perf_counter(), 0.0, 0.0
  for step in range(start_step + 1, total + 1):
    side_time += profiler.step(step, state)  # Writing a trace out is not step time.
    t0 = time.perf_counter()
    run.hang.phase('data')
    faults.inject(run.fault, step, 'data')
    guard.skip_offending_batch(step, train_iter)
    batch = next(train_iter)
    waited += time.perf_counter() - t0
    run.hang.phase('step')
    faults.inject(run.fault, step, 'step', settle=run.local.wait_until_finished if run.local else lambda: None)
    with jax.profiler.StepTraceAnnotation('train', step_num=step):  # Step markers for the profile's step view.
      t_dispatch = time.perf_counter()
      state, metrics = run.compiled_step(state, batch)
      dispatch_s = time.perf_counter() - t_dispatch  # Blocks while the devices are still busy with earlier steps.
    if step == start_step + 1:  # No transfer during the step's first run (a CUDA graph capture): data/device_feed.py.
      t_first = time.perf_counter()
      train_iter.release_after(metrics)
      dispatch_s += time.perf_counter() - t_first  # Blocked on the devices, as a fetch is: not host (straggler) time.
      runtime_oom.after_first_step(run.compiled_step, metrics)  # GPUs: the allocator's state against step 2's needs.
    if pending is not None:  # Fetch step-1's metrics while step runs: the one sync point per step.
      last_fetch, side_time = _finish(run, pending, window, last_fetch, side_time, evals, is_log_step, waited,
                                      dispatch_s)
      waited = 0.0
    pending = (step, metrics)

    t_side = time.perf_counter()
    noticed = run.notices.reached(step)
    preempted = preempt.reached(step) or noticed
    if step == total:
      preempt.done_checking()  # A stop signal in the final eval or save is answered after it (multi-process too).
    # Saved before it is evaluated: an eval that fails must not cost the steps trained (ckpt.close waits for it).
    if step % config.ckpt.every_steps == 0 or step == total or preempted:
      guard.check(step, metrics)  # Metrics come a step late; a state is checked before it is ever saved.
      run.hang.phase('checkpoint')
      if guard.may_save(step):
        ckpt.save(step, state, train_iter, run.manifest, force=True)
        guard.saved(step)
      elif preempted:
        preempted = 'unsaved'
    if run.local is not None and run.local.due(step) and guard.may_save(step):
      run.local.save(step, state, train_iter.get_state(), run.manifest)  # Copied, then written in the background.
    t_eval = time.perf_counter()
    failed = evaluation.at_step(run, state, step, total, preempted, evals)  # A failure: one line, recorded.
    run.writer.goodput.record_side(eval_s=time.perf_counter() - t_eval, checkpoint_s=t_eval - t_side)
    side_time += time.perf_counter() - t_side
    if preempted:
      ckpt.wait_until_finished()
      attempt.note(stopped='preempted', last_step=step)
      what = run.notices.describe() if noticed else preempt.describe()
      if preempted == 'unsaved':
        logging.warning('%s received: stopped at step %d without saving it (skipped steps outnumber good ones since '
                        'the last checkpoint, which a relaunch resumes from).', what, step)
      else:
        logging.warning('%s received: saved step %d to %s and stopped (the save took %.1fs). Relaunch the same '
                        'command to continue.', what, step, ckpt.directory, time.perf_counter() - t_side)
      break
  _finish(run, pending, window, last_fetch, side_time, evals, is_log_step, waited)
  profiler.close(state)  # A trace window reaching the last step ends here, once its steps finished.
  if failed and step == total:
    raise evaluation.final_failed(failed)


def _finish(run: 'RunContext', pending, window: Window, last_fetch: float, side_time: float,
            evals: dict[int, dict[str, float]], is_log_step, data_wait: float,
            dispatch_s: float = 0.0) -> tuple[float, float]:
  """Fetches one step's metrics (once, for the guardrails and the log), adds them to the window, logs if due.

  `data_wait` is the input wait measured since the previous fetch, all of it inside this step's time.
  """
  step, metrics = pending
  t_fetch = time.perf_counter()
  metrics = jax.device_get(metrics)
  window.device_waits.append(dispatch_s + time.perf_counter() - t_fetch)
  run.guard.check(step, metrics)
  run.idle_experts.step_done(step, metrics)
  objective, writer = run.objective, run.writer
  now = time.perf_counter()
  window.losses.append(float(metrics['loss']))
  # Eval and checkpoint time spent since the last fetch is not step time.
  window.step_times.append(max(now - last_fetch - side_time, 1e-9))
  window.data_waits.append(data_wait)
  writer.step_done(step, window.losses[-1], window.step_times[-1], data_wait, objective.units_per_step)
  run.hang.step_done(step, window.step_times[-1])
  if is_log_step(step):
    attempt.progress(step)
    summary = window.summary(metrics, objective.units_per_step, objective.unit, run.throughput)
    ready_share = run.train_iter.ready_share()
    if not window.first:
      data.warn_if_stalled(step, summary, ready_share)
    else:
      summary.update(run.first_log)  # An elastic attempt's size: a TensorBoard step at each change.
    if run.examples_per_epoch:  # Passes over the training data so far: every step takes one global batch.
      summary['epochs'] = step * run.config.train.batch_size / run.examples_per_epoch
    if run.sources:  # A mixture: tokens each source has given so far.
      summary.update(run.sources.tokens_seen(step))
    busy = float(np.mean(np.subtract(window.step_times, window.device_waits)))
    summary.update(run.stragglers.at_log(step, busy, summary['data_wait_s'], summary['step_time_s']))
    writer.write(step, {**summary, **evals.pop(step, {})})
    writer.write_histograms(step, {k: v for k, v in metrics.items() if np.ndim(v) == 1})  # MoE load per expert.
    window.__init__()
  return now, 0.0
