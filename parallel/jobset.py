"""A multi-host run on GKE: the JobSet manifest (or the `xpk workload create` command) for TPU slices or GPU nodes.

Entry points: `build(request)` -> the JobSet as a dict (scripts/launch_gke.py prints it or applies it), and
`xpk_command(request)` -> the same run as xpk's argv. `check(request, config)` refuses, before anything is written,
what would fail on the cluster: a topology the accelerator lacks, a multi-host workdir that is not gs://, a batch
that does not divide over the devices.

How the pods find each other: every pod runs launch.py with explicit `--coordinator_address` (pod 0 of slice 0,
through the JobSet's headless service), `--num_processes` and `--process_id = JOB_INDEX x hosts per slice +
JOB_COMPLETION_INDEX` (the slice's index from JobSet's annotation, the host's from the Indexed Job's): the same
check-in and peer watchdog as any explicit launch (parallel/distributed.py), on TPU and GPU alike. On TPU the pod
also gets what libtpu reads to wire the slice and the slices together (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES,
MEGASCALE_* for more than one slice), written out here rather than left to what GKE injects, so the manifest says
where every host and slice is.

Who restarts what: the JobSet. launch.py runs unsupervised in the pod (`--max_restarts=0`), so any failure ends
the pod; its Job fails (backoffLimit 0) and the JobSet recreates every Job (`failurePolicy.maxRestarts`, default 1),
and the new pods resume from the newest checkpoint in the bucket. A survivor of a lost pod exits 75 on its own
(the peer watchdog) or saves and stops on the SIGTERM of the recreation. What a restart cannot fix ends the JobSet
at once: exit 2 (a config or input error), 3 (a non-finite loss stopped the run), 130 (interrupted), through the
Job's podFailurePolicy and the JobSet's FailJobSet rule. A supervisor in the pod as well would restart the
survivors' training while the JobSet replaces them: two owners of one decision.
"""

import dataclasses
import math
import re

from parallel import mesh
from trainer.base.errors import UserError

API_VERSION = 'jobset.x-k8s.io/v1alpha2'
CONTAINER = 'train'
FINAL_EXIT_CODES = (2, 3, 130)  # launch.py's exits a restart cannot fix (docs/supervisor.md); the rest restart.
XPK_RESTARTABLE = '1,74,75,124'  # The same split for xpk, which restarts 42 and 127-255 by default.
_NAME = re.compile(r'^[a-z]([-a-z0-9]*[a-z0-9])?$')
_NAME_MAX = 40  # Pod hostnames are NAME-REPLICATEDJOB-J-I, a DNS label of at most 63 characters.


@dataclasses.dataclass(frozen=True)
class Platform:
  """One accelerator family as GKE schedules it."""
  gke_accelerator: str  # The node selector's value (cloud.google.com/gke-tpu-accelerator or gke-accelerator).
  resource: str  # The container's resource: google.com/tpu or nvidia.com/gpu.
  xpk_name: str  # xpk's --tpu-type prefix, or its whole --device-type for a GPU.
  dims: int = 0  # TPU topology dimensions; 0 for a GPU node pool.
  max_cubes: int = 0  # 3-D TPUs: the largest slice in 4x4x4 cubes.
  ordered: bool = False  # 3-D TPUs: dimensions must not decrease (v5p) or may come in any order (v4).
  gpus_per_node: int = 0


_SMALL_3D = ('2x2x1', '2x2x2', '2x2x4', '2x4x4')  # Below a cube; larger 3-D slices are whole 4x4x4 cubes.
_TOPOLOGIES_2D = ('1x1', '2x2', '2x4', '4x4', '4x8', '8x8', '8x16', '16x16')
PLATFORMS = {
    'v4': Platform('tpu-v4-podslice', 'google.com/tpu', 'v4', dims=3, max_cubes=64),
    'v5p': Platform('tpu-v5p-slice', 'google.com/tpu', 'v5p', dims=3, max_cubes=140, ordered=True),
    'v5e': Platform('tpu-v5-lite-podslice', 'google.com/tpu', 'v5litepod', dims=2),
    'v6e': Platform('tpu-v6e-slice', 'google.com/tpu', 'v6e', dims=2),
    'a3': Platform('nvidia-h100-80gb', 'nvidia.com/gpu', 'h100-80gb-8', gpus_per_node=8),
    'a3mega': Platform('nvidia-h100-mega-80gb', 'nvidia.com/gpu', 'h100-mega-80gb-8', gpus_per_node=8),
    'a3ultra': Platform('nvidia-h200-141gb', 'nvidia.com/gpu', 'h200-141gb-8', gpus_per_node=8),
}


@dataclasses.dataclass(frozen=True)
class Request:
  """What the user asked for (scripts/launch_gke.py's flags)."""
  name: str
  accelerator: str
  image: str
  config: str
  workdir: str
  topology: str = ''  # TPU: the slice's chip grid, e.g. 2x2x2 or 2x4.
  num_slices: int = 1  # TPU: slices joined over the data-centre network.
  # TPU, elastic: the slice count the config is written for, when this launch runs num_slices of them (0: not elastic).
  elastic_full_slices: int = 0
  num_nodes: int = 1  # GPU: nodes of gpus_per_node GPUs.
  overrides: tuple[str, ...] = ()  # More launch.py flags, --config.KEY=VALUE and the like, passed as they are.
  max_restarts: int = 1  # The JobSet's: group restarts before it gives up.
  queue: str = ''  # A Kueue LocalQueue; empty = none.
  service_account: str = ''  # The pods' Kubernetes service account (Workload Identity: the bucket's access).
  coordinator_port: int = 1234
  termination_grace_s: int = 300  # SIGTERM to SIGKILL: launch.py saves a checkpoint in between.
  cluster: str = ''  # xpk only: its --cluster.
  project: str = ''  # xpk only.
  zone: str = ''  # xpk only.

  @property
  def platform(self) -> Platform:
    return PLATFORMS[self.accelerator]

  @property
  def is_tpu(self) -> bool:
    return self.platform.dims > 0


@dataclasses.dataclass(frozen=True)
class Shape:
  """How the run lays out: `jobs` replicated Jobs (slices) of `hosts` pods with `chips` devices each."""
  jobs: int
  hosts: int
  chips: int

  @property
  def processes(self) -> int:
    return self.jobs * self.hosts

  @property
  def devices(self) -> int:
    return self.processes * self.chips


def _topology_error(request: Request) -> str | None:
  platform, topology = request.platform, request.topology
  if platform.dims == 2:
    if topology in _TOPOLOGIES_2D:
      return None
    return f'{request.accelerator} slices come as {", ".join(_TOPOLOGIES_2D)}'
  dims = topology.split('x')
  if topology in _SMALL_3D:
    return None
  sizes = [int(d) for d in dims] if len(dims) == 3 and all(d.isdigit() for d in dims) else []
  cubes = math.prod(s // 4 for s in sizes) if sizes else 0
  if (sizes and all(s % 4 == 0 and 4 <= s <= 256 for s in sizes) and cubes <= platform.max_cubes
      and (not platform.ordered or sizes == sorted(sizes))):
    return None
  order = ', in non-decreasing order' if platform.ordered else ''
  return (f'{request.accelerator} slices are {", ".join(_SMALL_3D)}, or AxBxC of multiples of 4 up to '
          f'{platform.max_cubes} 4x4x4 cubes{order}')


def shape(request: Request) -> Shape:
  """The layout of the request, or UserError naming the flag that does not fit the accelerator."""
  if request.accelerator not in PLATFORMS:
    raise UserError(f'--accelerator={request.accelerator!r} is not one of {", ".join(PLATFORMS)}.')
  platform = request.platform
  if not request.is_tpu:
    if request.topology or request.num_slices != 1:
      raise UserError(f'--accelerator={request.accelerator} is a GPU node pool: give --num_nodes, not --topology '
                      f'or --num_slices.')
    if request.num_nodes < 1:
      raise UserError(f'--num_nodes={request.num_nodes} must be at least 1.')
    return Shape(jobs=1, hosts=request.num_nodes, chips=platform.gpus_per_node)
  if request.num_nodes != 1:
    raise UserError(f'--accelerator={request.accelerator} is a TPU: give --topology (and --num_slices), not '
                    f'--num_nodes; the topology decides the hosts.')
  if not request.topology:
    raise UserError(f'--accelerator={request.accelerator} is a TPU: give its slice as --topology, e.g. '
                    f'{"2x2x2" if platform.dims == 3 else "2x4"}.')
  problem = _topology_error(request)
  if problem:
    raise UserError(f'--topology={request.topology!r} is not a {request.accelerator} slice: {problem}.')
  if request.num_slices < 1:
    raise UserError(f'--num_slices={request.num_slices} must be at least 1.')
  chips = math.prod(int(d) for d in request.topology.split('x'))
  per_host = 1 if chips == 1 else 4  # GKE's multi-host TPU machines carry 4 chips (ct5p-hightpu-4t, ...).
  return Shape(jobs=request.num_slices, hosts=chips // per_host, chips=per_host)


def check(request: Request, config) -> Shape:
  """Everything a cluster would refuse later, as one UserError now; returns the layout."""
  if not _NAME.match(request.name) or len(request.name) > _NAME_MAX:
    raise UserError(f'--name={request.name!r} must be lowercase letters, digits and dashes, starting with a letter, '
                    f'at most {_NAME_MAX} characters (it names the pods and their DNS hostnames).')
  layout = shape(request)
  if not 0 < request.coordinator_port < 65536:
    raise UserError(f'--coordinator_port={request.coordinator_port} is not a port: give one from 1 to 65535.')
  if request.max_restarts < 0:
    raise UserError(f'--max_restarts={request.max_restarts}: give the group restarts as a count >= 0.')
  if layout.processes > 1 and not request.workdir.startswith('gs://'):
    raise UserError(f'--workdir={request.workdir!r}: a {layout.processes}-host run needs a gs:// workdir, which every '
                    f'pod reads and writes as one and which outlives the pods (a restart resumes from it).')
  if request.elastic_full_slices:
    if not request.is_tpu or not request.num_slices <= request.elastic_full_slices or request.elastic_full_slices < 2:
      raise UserError(f'--elastic_full_slices={request.elastic_full_slices}: the TPU slices the run is written for, '
                      f'2 or more, with --num_slices (now {request.num_slices}) the ones left of them; a single '
                      f'slice or GPU nodes cannot shrink this way.')
    layout = dataclasses.replace(layout, jobs=request.elastic_full_slices)  # The config is checked at full size.
  if request.is_tpu and layout.jobs > 1 and _slices(config.mesh) != layout.jobs:
    slices = '--elastic_full_slices' if request.elastic_full_slices else '--num_slices'
    raise UserError(f'{slices}={layout.jobs}, but mesh.dcn_data x dcn_fsdp x dcn_pipeline = '
                    f'{_slices(config.mesh)}: slices are joined by the data-centre network only, so the mesh must '
                    f'split over them; add --config.mesh.dcn_data={layout.jobs} (docs/meshes.md).')
  sizes = [d * i for d, i in zip(mesh.dcn_shape(config.mesh, layout.devices),
                                 mesh.resolve_shape(config.mesh, layout.devices // _slices(config.mesh)))]
  data_parallel = math.prod(size for axis, size in zip(mesh.AXES, sizes) if axis in mesh.BATCH_AXES)
  unit, batch = math.lcm(data_parallel, layout.processes), config.train.batch_size
  if batch <= 0 or batch % unit:
    near = ' or '.join(str(b) for b in ((batch // unit) * unit, (batch // unit + 1) * unit) if b > 0)
    raise UserError(f'train.batch_size={batch} does not divide over the {data_parallel} data-parallel devices of '
                    f'{layout.devices} ({layout.processes} hosts x {layout.chips}); nearest valid: {near}.')
  return shape(request)


def _slices(mesh_config) -> int:
  return mesh_config.dcn_data * mesh_config.dcn_fsdp * mesh_config.get('dcn_pipeline', 1)


def _launch_args(request: Request) -> list[str]:
  """launch.py's flags, the same in every pod; the per-pod ones come from the environment (see `_entry`)."""
  elastic = [f'--elastic_full_processes={request.elastic_full_slices * shape(request).hosts}'] * bool(
      request.elastic_full_slices)
  return [f'--config={request.config}', f'--workdir={request.workdir}', '--max_restarts=0', *request.overrides,
          *elastic]


# The per-pod flags need arithmetic on the pod's indices, hence a shell; "$@" is _launch_args, untouched by it.
_ENTRY = ('exec python launch.py "$@" --coordinator_address="$COORDINATOR_ADDRESS" --num_processes="$NUM_PROCESSES" '
          '--process_id=$((JOB_INDEX * PROCESSES_PER_SLICE + JOB_COMPLETION_INDEX))')


def _final_exit_codes(request: Request) -> tuple[int, ...]:
  # An elastic run's slices that waited for a lost one and exit 76 end the JobSet: recreating the group would wait
  # for that slice again; the relaunch with the slices left is the next step (docs/supervisor.md, "Elastic runs").
  return FINAL_EXIT_CODES + ((76,) if request.elastic_full_slices else ())


def _field(name: str, path: str) -> dict:
  return {'name': name, 'valueFrom': {'fieldRef': {'fieldPath': path}}}


def _env(request: Request, layout: Shape, job: str) -> list[dict]:
  """Each pod's environment; $(VAR) refers to a variable above it (Kubernetes expands it)."""
  def host(job_index: str, i: int) -> str:
    return f'{request.name}-{job}-{job_index}-{i}.{request.name}'  # The JobSet's headless service names each pod.

  env = [_field('JOB_INDEX', "metadata.annotations['jobset.sigs.k8s.io/job-index']"),
         _field('JOB_COMPLETION_INDEX', "metadata.annotations['batch.kubernetes.io/job-completion-index']"),
         {'name': 'PROCESSES_PER_SLICE', 'value': str(layout.hosts)},
         {'name': 'NUM_PROCESSES', 'value': str(layout.processes)},
         {'name': 'COORDINATOR_ADDRESS', 'value': f'{host("0", 0)}:{request.coordinator_port}'}]
  if request.is_tpu:
    env += [{'name': 'TPU_WORKER_ID', 'value': '$(JOB_COMPLETION_INDEX)'},
            {'name': 'TPU_WORKER_HOSTNAMES', 'value': ','.join(host('$(JOB_INDEX)', i) for i in range(layout.hosts))}]
    if layout.jobs > 1:
      env += [{'name': 'MEGASCALE_NUM_SLICES', 'value': str(layout.jobs)},
              {'name': 'MEGASCALE_SLICE_ID', 'value': '$(JOB_INDEX)'},
              {'name': 'MEGASCALE_COORDINATOR_ADDRESS', 'value': host('0', 0)}]
  return env


def _pod(request: Request, layout: Shape, job: str) -> dict:
  platform = request.platform
  if request.is_tpu:
    selector = {'cloud.google.com/gke-tpu-accelerator': platform.gke_accelerator,
                'cloud.google.com/gke-tpu-topology': request.topology}
    ports = [request.coordinator_port, 8471, 8080]  # jax's coordinator, the TPU runtime, megascale (DCN).
  else:
    selector = {'cloud.google.com/gke-accelerator': platform.gke_accelerator}
    ports = [request.coordinator_port]
  container = {
      'name': CONTAINER, 'image': request.image, 'command': ['/bin/sh', '-c', _ENTRY, 'launch.py'],
      'args': _launch_args(request), 'env': _env(request, layout, job),
      'ports': [{'containerPort': p} for p in ports],
      'resources': {'limits': {platform.resource: layout.chips}}}
  spec = {'restartPolicy': 'Never', 'nodeSelector': selector, 'containers': [container],
          'terminationGracePeriodSeconds': request.termination_grace_s}
  if request.service_account:
    spec['serviceAccountName'] = request.service_account
  if not request.is_tpu:  # NCCL and jax's host transfers want more shared memory than a container's 64 MB.
    container['volumeMounts'] = [{'name': 'dshm', 'mountPath': '/dev/shm'}]
    spec['volumes'] = [{'name': 'dshm', 'emptyDir': {'medium': 'Memory'}}]
  return {'spec': spec}


def build(request: Request) -> dict:
  """The JobSet for `request` (checked first with `check`): one replicated Job per slice, or one of N GPU nodes."""
  layout = shape(request)
  job = 'slice' if request.is_tpu else 'node'
  metadata = {'name': request.name, 'labels': {'app.kubernetes.io/name': 'jax-launch'}}
  if request.queue:
    metadata['labels']['kueue.x-k8s.io/queue-name'] = request.queue
  if request.is_tpu:  # One slice per node pool: two Jobs never share a slice's hosts.
    metadata['annotations'] = {'alpha.jobset.sigs.k8s.io/exclusive-topology': 'cloud.google.com/gke-nodepool'}
  final = {'action': 'FailJob', 'onExitCodes': {'containerName': CONTAINER, 'operator': 'In',
                                                'values': list(_final_exit_codes(request))}}
  job_spec = {'parallelism': layout.hosts, 'completions': layout.hosts, 'completionMode': 'Indexed',
              'backoffLimit': 0, 'podFailurePolicy': {'rules': [final]}, 'template': _pod(request, layout, job)}
  return {
      'apiVersion': API_VERSION, 'kind': 'JobSet', 'metadata': metadata,
      'spec': {
          'failurePolicy': {'maxRestarts': request.max_restarts, 'restartStrategy': 'Recreate',
                            'rules': [{'name': 'final-exit-codes', 'action': 'FailJobSet',
                                       'onJobFailureReasons': ['PodFailurePolicy']}]},
          # Pod 0's name resolves before it is ready: the others reach the coordinator while it starts.
          'network': {'enableDNSHostnames': True, 'publishNotReadyAddresses': True},
          'replicatedJobs': [{'name': job, 'replicas': layout.jobs, 'template': {'spec': job_spec}}]}}


def xpk_command(request: Request) -> list[str]:
  """`xpk workload create` for the same run. xpk writes its own JobSet: on TPU jax finds the hosts from GKE's
  environment (launch.py with no coordinator flags); on GPU xpk's JAX_COORDINATOR_ADDRESS and NODE_RANK do."""
  layout = shape(request)
  command = ['python', 'launch.py', *_launch_args(request)]
  if not request.is_tpu and layout.processes > 1:
    command += [f'--coordinator_address=$JAX_COORDINATOR_ADDRESS:$JAX_COORDINATOR_PORT',
                f'--num_processes={layout.processes}', '--process_id=$NODE_RANK']
  argv = ['xpk', 'workload', 'create', f'--cluster={request.cluster}', f'--workload={request.name}',
          f'--docker-image={request.image}', f'--command={" ".join(_sh_word(w) for w in command)}']
  if request.is_tpu:
    argv += [f'--tpu-type={request.platform.xpk_name}-{request.topology}', f'--num-slices={layout.jobs}']
  else:
    argv += [f'--device-type={request.platform.xpk_name}', f'--num-nodes={layout.hosts}']
  argv += [f'--max-restarts={request.max_restarts}', f'--restart-on-exit-codes={XPK_RESTARTABLE}']
  argv += [f'--{flag}={value}' for flag, value in (('project', request.project), ('zone', request.zone)) if value]
  return argv


def _sh_word(word: str) -> str:
  """A word of xpk's --command, which runs under bash: $VARS expand, anything else unsafe is single-quoted."""
  if re.fullmatch(r'[\w@%+=:,./$-]+', word):
    return word
  return "'" + word.replace("'", "'\\''") + "'"
