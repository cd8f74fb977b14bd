"""The whole config stays in the run layer: the layers below receive their part of it (issue 44).

tests/config_flow.py follows the config object through one tiny launch and one --plan, in process. A function
may receive the whole config only if it is named below, with the reason it needs all of it; a new function taking
the whole config fails here until it takes its part (config.data, config.mesh, ...) or is named with a reason.
Names are `module_stem.qualname` (a package by its folder), so they survive modules moving between folders.
"""

import config_flow

# The run layer: the launch and the plan hold the whole config and build the Job from it.
RUN = {'loop.run', 'loop._run', 'loop._active_params', 'plan.run', 'plan._run', 'plan._limit', 'plan.report',
       'job.build_job', 'job._assemble',
       'load.configure'}  # model.init_from: config.json's model keys replace the file's, before anything is built.
# The config's own checks, which relate keys of several sections (parallel.strategy against the mesh, the pipeline
# against model and train).
CHECKS = {'validation.validate_config', 'validation.validate_strategy', 'validation.validate_grad_accum',
          'validation._check_context', 'validation._check_loss_chunks', 'pipeline_checks.check_config',
          'pipeline_checks._check_layers',
          'validation._check_preference',  # DPO against the data source, strategy, pipeline and loss chunks.
          'lora.check_config',  # LoRA against the model, its layer count and the pipeline.
          'config_schema.check', 'config_schema.problems', 'config_schema._get'}  # Every key's type and range.
# remat 'auto', made while the Job is built: candidates are copies of the config with other train settings, and
# the memory-relevant keys of every section are its fingerprint.
MEMORY = {'remat.resolve', 'remat.fingerprint', 'remat._with', 'remat._search', 'remat.step_bytes',
          'measure.with_overrides', 'measure.loss_chunks_worth_trying', 'job._candidate_bytes'}
# What records the run: the checkpoint manifest and TensorBoard's copy of the config.
RECORDS = {'manifest.run_manifest', 'metrics.MetricsWriter.write_config'}
# The model builder's contract (docs/bring_your_own_model.md): `build(config)` / `MyModel(config, *, rngs)` get the
# whole locked config, the built-in models too.
MODELS = {'task.build_task', 'task._require_chunkable_model', 'task._brought_model_keywords', 'adapters.adapt',
          'adapters._adapt',  # adapt's body: adapt turns what a model raises while built into one line.
          'adapters.call_builder', 'adapters._adapt_nnx', 'llama.build', 'llama.check_config', 'vit.build'}
ALLOWED = RUN | CHECKS | MEMORY | RECORDS | MODELS


def test_a_tiny_launch_hands_the_layers_below_the_run_their_part_of_the_config(tmp_path):
  flow = config_flow.tiny_launch(str(tmp_path / 'work'), steps=2)
  assert 'loop._run' in flow.direct and 'job.build_job' in flow.direct  # The hook saw the run.
  assert set(flow.direct) - ALLOWED == set(), sorted(set(flow.direct) - ALLOWED)
  # The memory choice is made by building the Job, not beside it in the loop.
  assert flow.callers['remat.resolve'] == {'job.build_job'}, flow.callers['remat.resolve']


def test_a_plan_hands_the_layers_below_the_run_their_part_of_the_config():
  flow = config_flow.tiny_plan()
  assert 'plan._run' in flow.direct
  assert flow.callers['remat.resolve'] == {'job.build_job'}, flow.callers['remat.resolve']
  assert set(flow.direct) - ALLOWED == set(), sorted(set(flow.direct) - ALLOWED)
