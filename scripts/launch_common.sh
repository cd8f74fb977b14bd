# shellcheck shell=bash
# Shared by scripts/launch_*.sh (sourced, never run): argument checks, and
# printing or running commands so that --dry_run shows exactly what a real run
# executes. Kept to the bash 3.2 of macOS, where TPU pods are often launched
# from: no associative arrays or mapfile, and possibly-empty arrays expanded as
# ${a[@]+"${a[@]}"} (bash < 4.4 calls "${a[@]}" of an empty array unbound).

SCRIPT=${0##*/}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY_RUN=0

die() {
  printf '%s: error: %s\n' "$SCRIPT" "$*" >&2
  exit 2
}

# Prints its arguments as one line of bash: plain words as they are, anything
# else in single quotes (after the '=' of an --option=value), so a printed
# command can be pasted back into a shell.
quote() {
  local plain='^[A-Za-z0-9_@%+=:,./-]+$' option='^(--?[A-Za-z0-9_.-]+=)(.*)$' word prefix out=''
  for word in "$@"; do
    if [[ ! $word =~ $plain ]]; then
      prefix=''
      if [[ $word =~ $option ]]; then
        prefix=${BASH_REMATCH[1]}
        word=${BASH_REMATCH[2]}
      fi
      word="$prefix'${word//\'/\'\\\'\'}'"
    fi
    out="$out${out:+ }$word"
  done
  printf '%s\n' "$out"
}

show() { printf '+ %s\n' "$(quote "$@")"; }

# Prints a command, then runs it unless this is a dry run.
run() {
  show "$@"
  if ((DRY_RUN)); then return 0; fi
  "$@"
}

# The same for a line with pipes, loops or $(...): printed as given, then eval'd.
run_line() {
  printf '+ %s\n' "$1"
  if ((DRY_RUN)); then return 0; fi
  eval "$1"
}

# require OPTION VALUE WHAT: fails when a required option was not given.
require() {
  [[ -n $2 ]] || die "--$1 is required: $3. See --help."
}

bad_argument() {
  die "unknown argument '$1'. Options take their value after '=' (--workdir=/path), overrides look like" \
    "--config.train.steps=100; see --help."
}

# The config file without config_flags' optional ':argument' suffix.
config_file() { printf '%s\n' "${1%%:*}"; }

# check_config CONFIG: the file must exist, relative to the current folder.
check_config() {
  local file
  file=$(config_file "$1")
  [[ -f $file ]] || die "--config=$1: no file $file (relative paths are taken from $PWD)."
}

# An absolute path for a folder that may not exist yet.
absolute() {
  case $1 in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$PWD/${1#./}" ;;
  esac
}

# The virtualenv from the README's quickstart if there is one, else python3.
default_python() {
  if [[ -x $REPO/.venv/bin/python ]]; then printf '%s\n' "$REPO/.venv/bin/python"; else printf 'python3\n'; fi
}

# need_tool TOOL HINT: a real run needs TOOL on PATH; a dry run does not.
need_tool() {
  if ((DRY_RUN)) || command -v "$1" >/dev/null 2>&1; then return 0; fi
  die "$1 not found on PATH: $2"
}
