"""Base config: declares every key the launcher reads, each with a one-line comment.

Experiment configs import this module, call `get_config()` and change fields.
Nothing here trains anything on its own; `configs/default.py` is the default job.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()

  c.train = config_dict.ConfigDict()
  c.train.steps = 1000  # Total optimizer steps of the run (a resumed run stops here too).
  c.train.batch_size = 64  # Global batch in sequences, summed over every device and process.
  c.train.seed = 0  # Seeds parameter init and the data shuffle.
  c.train.learning_rate = 3e-4  # Peak learning rate, reached after warmup.
  c.train.warmup_steps = 100  # Linear warmup from 0, then cosine decay to end_learning_rate_ratio.
  c.train.end_learning_rate_ratio = 0.1  # Final learning rate as a fraction of the peak.
  c.train.weight_decay = 0.1  # Decoupled weight decay (L2 for sgd), on matrices only: see train.weight_decay_exclude.
  c.train.adam_b1 = 0.9  # AdamW first-moment decay.
  c.train.adam_b2 = 0.95  # AdamW second-moment decay.
  # optimizers and schedules (issue 30)
  c.train.optimizer = 'adamw'  # 'adamw', 'adafactor', 'lion', 'muon' (Muon on weight matrices, AdamW on embeddings, head, norms) or 'sgd'.
  c.train.schedule = 'cosine'  # After warmup: 'cosine', 'linear', 'constant', 'wsd' (stable, then decay over decay_fraction) or 'rsqrt'.
  c.train.decay_fraction = 0.2  # 'wsd': the last fraction of train.steps that decays to end_learning_rate_ratio.
  c.train.decay_shape = 'linear'  # 'wsd': shape of the decay, 'linear' or '1-sqrt'.
  c.train.weight_decay_exclude = ()  # Regexes over '/'-joined parameter paths that get no decay (rank-1 parameters never do), e.g. ('embed',).
  c.train.adafactor_min_dim_size_to_factor = 128  # 'adafactor': dimensions at least this long get factored second moments.
  c.train.adafactor_decay_rate = 0.8  # 'adafactor': second-moment decay exponent (beta2_t = 1 - t^-rate).
  c.train.lion_b1 = 0.9  # 'lion': interpolation of gradient and momentum for the update's sign.
  c.train.lion_b2 = 0.99  # 'lion': momentum decay.
  c.train.muon_beta = 0.95  # 'muon': momentum decay of the matrices (Nesterov).
  c.train.muon_ns_steps = 5  # 'muon': Newton-Schulz iterations that orthogonalize each update.
  c.train.muon_consistent_rms = 0.2  # 'muon': matrix updates scaled to this RMS, so one learning_rate serves Muon and AdamW parameters.
  c.train.sgd_momentum = 0.9  # 'sgd': momentum; 0 = plain SGD.
  c.train.sgd_nesterov = False  # 'sgd': Nesterov momentum.
  c.train.ema_decay = 0.0  # > 0: keep a float32 moving average of the parameters (ema = d x ema + (1 - d) x params), checkpointed, evaluated as eval_ema_loss; 0 = off.
  c.train.grad_clip_norm = 1.0  # Clip gradients to this global norm; 0 disables clipping.
  c.train.compute_dtype = 'auto'  # 'auto' (bfloat16 on GPU/TPU, float32 on CPU), 'float32' or 'bfloat16'.
  c.train.quantization = config_dict.placeholder(str)  # Layer matmuls (Llama: attention projections, MLP; other models: parameter matmuls but embeddings and head) in 'fp8' (Ada/Hopper+ GPUs, TPU7x) or 'int8' (TPU v5e/v5p/v6e), per-tensor current scaling (trainer/models/quantization.py); None = train.compute_dtype.
  c.train.param_dtype = 'float32'  # Storage dtype of parameters and optimizer state.
  c.train.remat_policy = 'none'  # Per-block rematerialization: 'auto' (least recomputation that fits, trainer/memory/remat.py), 'none', 'full', 'dots_saveable', 'dots_with_no_batch_dims_saveable', 'save_qkv_proj', 'save_attention_and_mlp_hidden'.
  c.train.adam_mu_dtype = 'float32'  # Storage dtype of the first moment (momentum) of adamw, muon, lion and sgd; 'bfloat16' halves it (Adam's second moment stays float32).
  c.train.device_memory_gb = config_dict.placeholder(float)  # GiB one device may use (pre-flight check, remat 'auto'); None = the device's reported limit (CPU reports none).
  c.train.pipeline_microbatches = 0  # mesh.pipeline > 1: microbatches each step's (accumulation) batch is cut into for the stages; 0 = one per stage.
  c.train.pipeline_repeats = 1  # mesh.pipeline > 1: layer groups per stage (circular schedule); the bubble is (S-1)/(repeats x microbatches + S-1).
  c.train.grad_accum_steps = 1  # Microbatches per step, run by lax.scan with gradients summed: the same update in less memory.
  c.train.loss_chunks = 1  # > 1: the output head and loss run on this many slices of positions, so the (batch, seq_len, vocab) logits are never held whole (one more head matmul per token); must divide data.seq_len.
  c.train.z_loss_weight = 0.0  # Weight of the z-loss mean(logsumexp(logits)^2), which keeps logits from drifting; 0 disables it (PaLM used 1e-4).
  c.train.objective = 'task'  # 'task': model.task's own loss; 'dpo': direct preference optimization on pairs that scripts/prepare_data.py wrote from chosen/rejected JSONL, against the starting weights (docs/dpo.md).
  c.train.dpo_beta = 0.1  # 'dpo': strength of the pull towards the reference (TRL's beta): the implicit reward is beta x the log-probability ratio to it.
  c.train.dpo_label_smoothing = 0.0  # 'dpo': the fraction of pairs assumed mislabelled (cDPO / robust DPO); 0 = plain DPO, below 0.5.
  c.train.compilation_cache_dir = config_dict.placeholder(str)  # Persistent XLA compilation cache folder shared by runs; None disables it.
  c.train.eval_every_steps = 200  # Evaluate on held-out data every N steps and at the last step; 0 = only at the end.
  c.train.eval_batches = 8  # Global batches per evaluation (fewer if the held-out set is smaller).
  # Hang watch (issue 29; trainer/supervision/hang.py)
  c.train.hang_timeout_s = config_dict.placeholder(float)  # No progress this long ends the attempt with every thread's stack written; None = 30 min before the first step, then max(10 x median step, 10 min); 0 = off.
  c.train.straggler_warn_fraction = 0.2  # Warn when one process's host time per step exceeds the others' median by this fraction of the step, 3 log intervals in a row.
  c.train.preemption_signals = ('SIGTERM',)  # Signals that make the run save at the next step and stop (e.g. add 'SIGUSR2' for sbatch --signal=USR2@120); SIGTERM is always one.
  c.train.preemption_notice_file = config_dict.placeholder(str)  # A file whose appearance (or change) during the run means the same, checked every 10 steps (e.g. touched by a GKE preStop hook); None = none.
  c.train.accept_schedule_change = False  # Resume even when changed train.* settings (e.g. a longer train.steps under cosine decay) move the learning rate at the resume step; refused otherwise.
  c.train.on_nonfinite = 'stop'  # Non-finite loss/gradient: 'stop' (exit 3, last good checkpoint kept), 'skip' (drop the update) or 'rollback' (reload the last checkpoint, skip the batch).

  c.mesh = config_dict.ConfigDict()
  c.mesh.data = -1  # Devices on the data-parallel axis; -1 fills with the devices left over.
  c.mesh.fsdp = 1  # Devices on the fully-sharded data-parallel axis (parameters sharded, batch split).
  c.mesh.pipeline = 1  # Stages the scanned layers are split into, each passing its activations on (trainer/pipeline/).
  c.mesh.expert = 1  # Devices on the expert axis: MoE expert weights split over it, the batch split over it too.
  c.mesh.context = 1  # Devices each row's tokens are split over (long sequences; attention gathers keys/values across it, docs/context.md).
  c.mesh.tensor = 1  # Devices on the tensor-parallel axis (heads, mlp and vocab split).
  # data/fsdp/tensor above are per slice (fast ICI links); these multiply them across slices or
  # hosts joined by the slower data-centre network, which should carry only batch-parallel traffic.
  c.mesh.dcn_data = 1  # Slices (or host groups) on the data axis.
  c.mesh.dcn_fsdp = 1  # Slices (or host groups) on the fsdp axis.
  c.mesh.dcn_pipeline = 1  # Slices (or host groups) on the pipeline axis.

  c.parallel = config_dict.ConfigDict()
  c.parallel.strategy = 'jit'  # 'jit' (GSPMD), 'shard_map' (explicit collectives; tensor=1) or 'pmap' (replicated; fsdp=tensor=1).
  # Logical axis name -> mesh axis (or tuple of axes, or None = replicated).
  c.parallel.logical_axis_rules = (
      ('batch', ('data', 'fsdp', 'expert')),  # The expert axis splits the batch too (parallel/mesh.py says why).
      ('embed', 'fsdp'),
      ('heads', 'tensor'),
      ('mlp', 'tensor'),
      ('vocab', 'tensor'),
      ('head_dim', None),
      ('length', 'context'),  # Activations' sequence axis; no parameter is named 'length' in the LM.
      ('norm', None),
      ('kv_heads', 'tensor'),  # Key/value heads of grouped-query attention.
      ('layers', None),  # The stacked axis of scanned blocks: every device holds every layer's shard.
      ('patch', None),  # Pixels of one image patch (ViT's patch embedding input).
      ('classes', None),  # A classifier's output classes.
      ('expert', 'expert'),  # MoE experts (trainer/models/moe.py); a brought model's 'expert' axis names get it too.
      ('expert_mlp', 'tensor'),  # An expert's hidden width.
  )
  c.parallel.extra_axis_rules = ()  # Rules tried before logical_axis_rules (the first naming an axis wins), e.g. (('model', 'tensor'),) for a model written for a mesh with a 'model' axis.
  c.parallel.unnamed_params = 'auto'  # Parameters with no axis names: 'auto' (replicate small ones, split the largest dim of big ones over fsdp), 'replicate' or 'error'.

  c.ckpt = config_dict.ConfigDict()
  c.ckpt.every_steps = 500  # Save a checkpoint every N steps; the last step is always saved.
  c.ckpt.max_to_keep = 3  # Newest checkpoints kept on disk; older ones are deleted after a save.
  c.ckpt.keep_period = 0  # Also keep every checkpoint whose step divides by N, forever; 0 = none.
  # The issue's `ckpt.async`: `async` is a Python keyword, so the key is async_save.
  c.ckpt.storage_deadline_s = 120.0  # gs:// workdirs: a probe, lock or manifest read with no answer this long ends the launch in one line (exit 74, retried by the supervisor).
  c.ckpt.async_save = True  # Write checkpoints in the background while training goes on.
  c.ckpt.local_dir = config_dict.placeholder(str)  # The local tier: each process's shards (and a copy of its peer's) in this folder on its own host, a RAM disk such as /dev/shm or local SSD; None = off. docs/checkpoints.md.
  c.ckpt.local_every_steps = 10  # With ckpt.local_dir: save the local tier every N steps.

  c.log = config_dict.ConfigDict()
  c.log.every_steps = 50  # Write metrics and a progress line every N steps (and at step 1).
  c.log.idle_expert_steps = 100  # MoE: warn when an expert receives no tokens this many steps in a row; 0 = off.
  c.log.progress_bar = 'auto'  # 'auto': a live bar when stderr is a terminal; 'on'; 'off' (log lines only).
  # Trackers (issue 42; trainer/observe/trackers/, docs/monitoring.md)
  c.log.trackers = ()  # Also log to these, beside TensorBoard and metrics.jsonl: 'wandb', 'mlflow' (process 0; an unreachable one warns once and is dropped).
  c.log.run_name = config_dict.placeholder(str)  # The run's name in the trackers; None = the workdir's folder name.
  c.log.wandb_project = 'jax-launch'  # Weights & Biases project.
  c.log.wandb_mode = 'online'  # 'online', or 'offline' (air-gapped: written under WORKDIR/wandb, uploaded later with `wandb sync`).
  c.log.mlflow_tracking_uri = config_dict.placeholder(str)  # Any MLflow tracking URI or a local folder; None = $MLFLOW_TRACKING_URI, else WORKDIR/mlruns.
  c.log.mlflow_experiment = 'jax-launch'  # MLflow experiment the run is logged under.
  c.log.tracker_close_timeout_s = 60.0  # At the end, seconds the trackers get to send what is left before it is dropped.

  # Downstream evals (issue 42; trainer/evals/, docs/evals.md)
  c.eval = config_dict.ConfigDict()
  c.eval.tasks = ()  # JSONL multiple-choice task files scored on the training mesh (metrics eval_<file stem>_acc, _acc_norm); () = none.
  c.eval.every_steps = 0  # Score eval.tasks every N steps and at the last step; 0 = at every checkpoint save.
  c.eval.max_questions = 0  # Score only the first N questions of each task file; 0 = all.

  c.profile = config_dict.ConfigDict()
  c.profile.trace_window = False  # True: trace steps start_step .. start_step + num_steps - 1 into WORKDIR.
  c.profile.start_step = 10  # First traced step; past the first steps, so compile and warm-up stay out.
  c.profile.num_steps = 5  # Steps per trace: the scheduled window and each SIGUSR1-triggered capture.
  c.profile.server_port = 0  # Start jax.profiler's server on this port for TensorBoard's on-demand capture; 0 = off.
  c.profile.memory_on_oom = True  # On an out-of-memory error save a device memory profile (pprof) into WORKDIR.

  c.data = config_dict.ConfigDict()
  c.data.source = 'text'  # 'text' (bytes of text_dir's files), 'array_record' (prepare_data.py shards), 'mixture' (several, by weight), 'arrays' (.npz), 'synthetic'.
  c.data.text_dir = config_dict.placeholder(str)  # Folder of text files; None = the running Python's stdlib.
  c.data.path = config_dict.placeholder(str)  # 'array_record': folder from scripts/prepare_data.py; 'arrays': .npz or folder of .npy.
  c.data.mixture = ()  # data.source='mixture': ((prepared folder, weight), ...) drawn by weight (docs/data.md).
  c.data.mixture_stages = ()  # Mixture: ((step, (weight, ...)), ...): new weights from that step on.
  c.data.packing = False  # Pack documents into rows with segment_ids/positions (no attention or loss across documents).
  # Packed positions for brought models (issue 24)
  c.data.packed_positions = 'document'  # Packing: 'document' (offset in the document) or 'row' (offset in its piece of the row, < seq_len: for learned position tables).
  c.data.max_documents_per_row = 64  # Packing: most documents in a row, checked before compile; sizes cuDNN's attention.
  c.data.loss_mask = False  # True: only targets the shards mark count in the loss (completions of prepare_data.py's prompt/completion JSONL); metric trained_tokens.
  c.data.worker_count = 0  # Grain worker processes per process; 0 reads in-process (threads only).
  c.data.prefetch = 2  # Batches read ahead of the train step (by a thread, or per worker); 0 = off.
  c.data.file_glob = '**/*.py'  # Files under text_dir to read, as a pathlib glob.
  c.data.eval_percent = 5  # Percent of files (text; prepare_data.py for shards) or rows (arrays) held out for eval.
  c.data.seq_len = 256  # Tokens per training sequence.
  c.data.num_threads = 4  # Grain read threads per process.
  c.data.prefetch_buffer_size = 64  # Grain prefetch buffer, in batches-of-elements, per process.
  c.data.image_shape = (32, 32, 3)  # Classifier inputs (height, width, channels); .npz images must have this shape.

  c.model = config_dict.ConfigDict()
  c.model.name = 'llama'  # A registered model ('llama', 'vit') or your own as an import path 'my_pkg.my_module:MyModel'.
  c.model.task = 'lm'  # 'lm' (next-token loss; eval loss, perplexity) or 'classifier' (images -> labels; eval loss, accuracy).
  c.model.num_layers = 4  # Transformer blocks.
  c.model.d_model = 256  # Residual stream width.
  c.model.num_heads = 4  # Attention heads; d_model must divide by it.
  c.model.head_dim = 0  # Width of each attention head; 0 = d_model / num_heads (Mistral Nemo and Qwen3 set their own, e.g. 128 at d_model 5120).
  c.model.mlp_dim = 1024  # Hidden width of the SwiGLU MLP.
  c.model.vocab_size = 256  # Vocabulary; 256 = raw bytes, no tokenizer.
  c.model.rope_max_wavelength = 10_000.0  # RoPE base wavelength (a float: published configs give e.g. 500000.0).
  c.model.norm_eps = 1e-6  # RMSNorm epsilon.
  # Published weights (issue 26; trainer/hf/, docs/hf.md)
  c.model.init_from = config_dict.placeholder(str)  # 'hf:/local/model_dir': a fresh run starts from its config.json and safetensors weights; None = random init.
  c.model.rope_scaling = 'none'  # 'none' or 'llama3' (Llama 3.1+ RoPE frequencies, set by the four keys below).
  c.model.rope_scaling_factor = 8.0  # 'llama3': how many times slower the long-wavelength pairs turn.
  c.model.rope_low_freq_factor = 1.0  # 'llama3': wavelengths above original_max_positions / this are slowed fully.
  c.model.rope_high_freq_factor = 4.0  # 'llama3': wavelengths below original_max_positions / this are unchanged.
  c.model.rope_original_max_positions = 8192  # 'llama3': the context the model was first trained at.
  c.model.qkv_bias = False  # Biases on the query, key and value projections (Qwen2); none on the output projection.
  c.model.qk_norm = False  # RMSNorm of each query and key head before RoPE (Qwen3).
  c.model.num_kv_heads = 0  # Grouped-query attention: key/value heads, dividing num_heads; 0 = num_heads (multi-head).
  c.model.tie_embeddings = False  # The output head reuses the input embedding table (GPT-2, Llama 3.2 1B) instead of its own.
  c.model.num_classes = 10  # Classifier output classes; labels are integers in [0, num_classes).
  c.model.patch_size = 4  # ViT: square patch side in pixels; data.image_shape's height and width must divide by it.
  # True scans one block over stacked layer parameters (compile time flat in depth), False unrolls (faster steps at
  # small depth: 2 layers ran 40% faster unrolled on CPU); 'auto' scans above 4 layers (trainer/models/layer_scan.py).
  c.model.scan_layers = config_dict.FieldReference('auto', field_type=object)  # True, False or 'auto' (any type).
  c.model.attention = 'auto'  # Attention kernel: 'auto' (cuDNN on NVIDIA GPUs, splash on TPUs, XLA elsewhere; the log says which and why), 'xla', 'cudnn' or 'splash'.
  c.model.context_scheme = 'auto'  # How attention crosses mesh.context > 1: 'auto' (the all-gather where splash runs the blocks, on TPU; the ring elsewhere: measured, trainer/attention/context.py), 'all-gather' of keys/values, or 'ring' (ppermute of key/value blocks, an online softmax; XLA blocks only) (docs/context.md).
  c.model.check_alignment = True  # Your own 'lm' model: before step 1, probe that logits[t] read inputs[t] and no later input (trainer/models/contract.py).
  # Brought models' call conventions (issue 24)
  c.model.call_kwargs = ()  # Your model's constant call keywords as (name, value) pairs, e.g. (('train', True),); also at init.
  c.model.eval_call_kwargs = ()  # Those to use in eval instead (same form), e.g. (('train', False),); the rest of call_kwargs stay.
  c.model.packed_kwarg_names = ('segment_ids', 'positions')  # The keywords packed rows reach your model by, e.g. ('inputs_segmentation', 'inputs_positions') (flax lm1b).
  c.model.unshifted_inputs = False  # True: your model shifts its rows right itself (flax lm1b, wmt); it is fed the targets, so logits[t] still score targets[t].
  # Mixture of experts (issue 28; trainer/models/moe.py, docs/moe.md)
  c.model.num_experts = 0  # > 0: the Llama's MLPs (those model.moe_layers picks) become this many experts; 0 = dense.
  c.model.experts_per_token = 2  # Top-k: experts each token is routed to, their weights renormalized to sum to 1.
  c.model.moe_layers = config_dict.FieldReference('all', field_type=object)  # 'all', or k: every k-th layer (k-1, 2k-1, ...) is MoE.
  c.model.shared_expert = False  # MoE layers also run one dense MLP of expert_mlp_dim on every token.
  c.model.expert_mlp_dim = 0  # Hidden width of each expert's SwiGLU MLP; 0 = model.mlp_dim.
  c.model.expert_capacity_factor = config_dict.placeholder(float)  # None/0: dropless (grouped matmuls); > 0: each expert takes ceil(factor x tokens x k / experts) assignments, the rest dropped and counted.
  c.model.expert_exchange = 'auto'  # Dropless tokens over mesh.expert: 'ragged' (ragged_all_to_all, only the rows routed), 'padded' (all_to_all of worst-case buffers), 'auto' (ragged on NVIDIA GPUs, padded elsewhere).
  c.model.expert_buffer_factor = config_dict.placeholder(float)  # Dropless over mesh.expert: None or 0, receive buffers with room for every assignment (exact); f > 0, for f x the balanced load (tokens x k), the overflow dropped and counted.
  c.model.router_aux_loss_weight = 0.01  # Weight of the Switch load-balancing loss (1.0 when balanced), mean over MoE layers.
  c.model.router_z_loss_weight = 0.001  # Weight of the router z-loss mean(logsumexp(router logits)^2), mean over MoE layers.
  c.model.router_bias_rate = 0.0  # > 0: DeepSeek-V3's load-balancing bias on expert choice, moved this much per step.
  # LoRA (issue 60; trainer/models/lora.py, docs/lora.md): the built-in Llama's base weights frozen, low-rank adapters trained
  c.model.lora_rank = 0  # > 0: adapters of this rank on model.lora_targets, the base weights frozen (no optimizer state); 0 = off.
  c.model.lora_targets = ('query', 'key', 'value', 'out', 'gate', 'up', 'down')  # Matmuls adapted: attention 'query', 'key', 'value', 'out'; MLP 'gate', 'up', 'down' (MoE experts are not).
  c.model.lora_alpha = 16.0  # The adapters' output is scaled by lora_alpha / lora_rank (PEFT's lora_alpha).

  return c
