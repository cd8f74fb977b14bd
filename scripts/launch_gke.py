"""Trains on GKE: writes the JobSet for TPU slices or a GPU node pool and applies it with kubectl (docs/clusters.md).

  python scripts/launch_gke.py --name=run1 --accelerator=v5p --topology=2x2x2 --image=IMAGE \\
      --config=configs/default.py --workdir=gs://BUCKET/run1 [--config.train.steps=2000 ...] [--dry_run | --xpk]

Every pod runs `python launch.py --config=... --workdir=... --max_restarts=0` with the overrides given here; the
JobSet restarts the whole group (--max_restarts, default 1) from the newest checkpoint when a pod is lost
(parallel/jobset.py says who restarts what). --dry_run prints the manifest (YAML); --xpk prints the equivalent
`xpk workload create` command instead. Neither needs kubectl or xpk. The checks run first: a bad topology, a
multi-host workdir that is not gs:// or a batch that does not divide over the devices is one line and exit 2.
"""

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
_PROG = 'launch_gke.py'


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=_PROG, description=__doc__, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add = parser.add_argument
  add('--name', required=True, help='the JobSet (and pod name prefix): lowercase letters, digits, dashes')
  add('--accelerator', required=True, help='TPU v4, v5p, v5e, v6e, or GPU nodes a3 (8 x H100), a3mega, a3ultra (H200)')
  add('--topology', default='', help='TPU: the slice, e.g. 2x2x2 (v5p, v4) or 2x4 (v5e, v6e)')
  add('--num_slices', type=int, default=1, help='TPU: slices joined over the data-centre network (default 1)')
  add('--elastic_full_slices', type=int, default=0,
      help='TPU, elastic: the slices the config is written for (mesh.dcn_data); --num_slices are the ones left of '
           'them, and each launch.py recomputes its mesh and accumulation for those (docs/supervisor.md, "Elastic '
           'runs"); 0 = not elastic (default)')
  add('--num_nodes', type=int, default=1, help='GPU: nodes of 8 GPUs (default 1)')
  add('--image', required=True, help='the container image with this repo (Dockerfile), e.g. REGION-docker.pkg.dev/...')
  add('--config', required=True, help='experiment config inside this repo, e.g. configs/default.py')
  add('--workdir', required=True, help='gs://BUCKET/RUN: every pod reads and writes it; restarts resume from it')
  add('--max_restarts', type=int, default=1, help="the JobSet's group restarts (default 1); launch.py gets 0")
  add('--queue', default='', help='a Kueue LocalQueue to submit through (label kueue.x-k8s.io/queue-name)')
  add('--service_account', default='', help="the pods' Kubernetes service account, bound to one with the bucket's "
      'roles/storage.objectUser (Workload Identity); default: the namespace\'s')
  add('--coordinator_port', type=int, default=1234, help="pod 0's port for jax's coordinator (default 1234)")
  add('--termination_grace_s', type=int, default=300, help='SIGTERM to SIGKILL; a stopped pod saves in between')
  add('--dry_run', action='store_true', help='print the manifest; apply nothing')
  add('--xpk', action='store_true', help='print the `xpk workload create` command for the same run instead')
  add('--cluster', default='', help='--xpk: the GKE cluster')
  add('--project', default='', help='--xpk: the Google Cloud project (default: gcloud config)')
  add('--zone', default='', help='--xpk: the cluster zone (default: gcloud config)')
  return parser


def _fail(message: str) -> int:
  print(f'{_PROG}: error: {message}', file=sys.stderr)
  return 2


def _load_config(path: str, overrides: list[str]):
  """The config launch.py will see, overrides applied by the same config_flags (the batch check reads it)."""
  from absl import flags
  from ml_collections import config_flags
  argv = [_PROG, f'--config={REPO / path}', *overrides]
  values = flags.FlagValues()
  # sys_argv: config_flags finds which overrides to define in it (the process's own argv by default).
  config_flags.DEFINE_config_file('config', None, 'config', flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  return values.config


def _request(args, overrides: list[str]):
  from parallel import jobset
  return jobset.Request(
      name=args.name, accelerator=args.accelerator, image=args.image, config=args.config, workdir=args.workdir,
      topology=args.topology, num_slices=args.num_slices, elastic_full_slices=args.elastic_full_slices,
      num_nodes=args.num_nodes, overrides=tuple(overrides),
      max_restarts=args.max_restarts, queue=args.queue, service_account=args.service_account,
      coordinator_port=args.coordinator_port, termination_grace_s=args.termination_grace_s, cluster=args.cluster,
      project=args.project, zone=args.zone)


def main(argv: list[str]) -> int:
  args, overrides = _parser().parse_known_args(argv)
  stray = [a for a in overrides if not a.startswith('--config.')]
  if stray:
    return _fail(f'{stray[0]}: not a flag of this script, and launch.py flags pass only as --config.KEY=VALUE '
                 f'overrides (the coordinator, process count and id come from the JobSet); see --help.')
  config_file = args.config.split(':')[0]
  if Path(config_file).is_absolute() or not (REPO / config_file).is_file():
    return _fail(f'--config={args.config}: no file {config_file} inside {REPO}; the image holds this repo, so give '
                 f'a path relative to it, e.g. configs/default.py.')
  if args.xpk and not args.cluster:
    return _fail('--xpk needs --cluster=CLUSTER (the GKE cluster xpk submits to).')
  from trainer.base.errors import UserError
  from parallel import jobset
  request = _request(args, overrides)
  try:
    config = _load_config(args.config, overrides)
    layout = jobset.check(request, config)
    if args.elastic_full_slices:  # What each launch.py will run on the slices left, refused here as it would be there.
      from trainer.supervision import elastic
      size = elastic.plan(config.mesh, config.train, args.elastic_full_slices * layout.hosts, layout.processes,
                          layout.chips)
      print(f'{_PROG}: {size.describe()}', file=sys.stderr)
  except UserError as e:
    return _fail(str(e))
  except (AttributeError, KeyError, ValueError, TypeError) as e:  # config_flags' bad override or unloadable file.
    return _fail(f'--config={args.config} with {" ".join(overrides) or "no overrides"}: {" ".join(str(e).split())}')
  if args.xpk:
    print(shlex.join(jobset.xpk_command(request)))
    return 0
  import yaml  # PyYAML comes with the pinned flax, orbax and ml-collections: no dependency of its own.
  text = yaml.safe_dump(jobset.build(request), sort_keys=False)
  if args.dry_run:
    print(text, end='')
    return 0
  if not shutil.which('kubectl'):
    return _fail('kubectl not found on PATH: install it and point it at the cluster (gcloud container clusters '
                 'get-credentials CLUSTER), or pass --dry_run to print the manifest.')
  return subprocess.run(['kubectl', 'apply', '-f', '-'], input=text, text=True, env=os.environ, check=False).returncode


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
