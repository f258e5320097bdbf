# shellcheck shell=sh
# The vLLM host snapshot's sections, one function each. gpufleet.vllm.host_command sends this file, then one line
# per function call with its arguments, in one command; docs/deploy.md explains the design. Read-only: nothing on
# the host changes. Every program that can hang runs under $t, and every curl request has its own --max-time.

# begin MARKER TIMEOUT_S DOCKER_SOCKET
begin() {
  export LC_ALL=C
  marker=$1
  timeout_s=$2
  socket=$3
  t="timeout -k 2 $timeout_s"
  command -v timeout >/dev/null 2>&1 || t=
  # A newline, for cutting text with the shell's own ${...%%...}.
  nl=$(printf '\n.')
  nl=${nl%.}
  nv=0
  command -v nvidia-smi >/dev/null 2>&1 && nv=1
}

# The marker line that opens a section. The leading newline ends a file read without a final newline.
section() {
  printf '\n%s%s\n' "$marker" "$1"
}

read_os() {
  section os
  while IFS= read -r l || [ -n "$l" ]; do printf '%s\n' "$l"; done 2>/dev/null </etc/os-release
  section arch
  dpkg --print-architecture 2>/dev/null || uname -m
  section nvidia_smi
  echo "$nv"
}

# Runs "$@" and prints its output and `@@rc <status>`, kept in $g and $r. A timeout means a wedged driver: the
# later queries are skipped, as each would wait as long again.
ask_nvidia() {
  g=$($t "$@" 2>&1)
  r=$?
  printf '%s\n@@rc %s\n' "$g" "$r"
  case $r in 124|137) nv=0 ;; esac
}

# read_gpus QUERY...: $gd becomes the driver version of the first row (its 7th field).
read_gpus() {
  gd=
  section gpus
  [ "$nv" = 1 ] || return 0
  ask_nvidia "$@"
  [ "$r" = 0 ] || return 0
  gd=${g%%"$nl"*}
  gd=${gd#*, *, *, *, *, *, }
  gd=${gd%%,*}
  case $gd in ''|*[!0-9.]*) gd= ;; esac
}

# read_driver VERSION_FILE QUERY...: the version file ('' for none) when it names the driver $gd with a CUDA version,
# else the live query. Shell builtins only: a file hit starts no program.
read_driver() {
  vf=
  vk=
  if [ -n "$1" ] && [ -n "$gd" ]; then
    # vk collects d for the matching driver line and c for a numeric CUDA line.
    while IFS= read -r l || [ -n "$l" ]; do
      vf=$vf$l$nl
      case $l in
        'DRIVER version'*:*) [ "${l##* }" = "$gd" ] && vk=${vk}d ;;
        'CUDA Version'*:*) case ${l##* } in ''|*[!0-9.]*) ;; *) vk=${vk}c ;; esac ;;
      esac
    done 2>/dev/null <"$1"
  fi
  shift
  if [ "$vk" = dc ]; then
    section driver_file
    printf '%s' "$vf"
  else
    section driver
    if [ "$nv" = 1 ]; then ask_nvidia "$@"; fi
  fi
}

# The health query and the kernel log, where the GPU query listed GPUs. query_gpu_health and read_kernel_log come
# from gpufleet.facts.gpu_health, sent before this file.
read_gpu_health() {
  section gpu_health
  if [ "$nv" = 1 ] && [ -n "$gd" ]; then
    query_gpu_health
    case $r in 124|137) nv=0 ;; esac
  fi
  section kernel_log
  if [ "$nv" = 1 ] && [ -n "$gd" ]; then read_kernel_log; fi
}

# read_docker_config DAEMON_JSON: the file, and $d: Docker's data-root or its nearest existing ancestor. sed runs
# only when a line names data-root.
read_docker_config() {
  section daemon_json
  dr=
  while IFS= read -r l || [ -n "$l" ]; do
    printf '%s\n' "$l"
    case $l in *data-root*) dr=1 ;; esac
  done 2>/dev/null <"$1"
  root=
  [ -n "$dr" ] && root=$(sed -n 's/.*"data-root"[[:space:]]*:[[:space:]]*"\([^"]*\)".*/\1/p' "$1" 2>/dev/null)
  d=${root:-/var/lib/docker}
  while [ ! -e "$d" ]; do d=$(dirname "$d"); done
}

# read_free MODELS_DIR: the free KiB (df's 4th column) at $d and at the models dir's nearest existing ancestor.
read_free() {
  m=$1
  while [ ! -e "$m" ]; do m=$(dirname "$m"); done
  section free
  $t df -Pk "$d" "$m" | {
    read -r _
    read -r _ _ _ a _
    read -r _ _ _ b _
    echo "docker $d $a"
    echo "models $m $b"
  }
}

# read_site_cache STORAGE: the KiB the site cache holds, the KiB free beside it, and whether that is $d's filesystem.
read_site_cache() {
  section site_cache
  u=$($t du -sk "$1" 2>/dev/null | cut -f1)
  echo "used ${u:-0}"
  c=$1
  while [ ! -e "$c" ]; do c=$(dirname "$c"); done
  $t df -Pk "$d" "$c" | {
    read -r _
    read -r fd _ _ _ _
    read -r fc _ _ a _
    echo "free $a $c"
    [ "$fd" != "$fc" ] || echo shares_docker
  }
}

# probe_group ADDRESS PORT TIMEOUT_S: one connect to a group head's master port, nothing sent. Connected or refused
# means the head's host answered.
probe_group() {
  section group_probe
  # shellcheck disable=SC2016 # bash's own $1 and $2
  timeout -k 1 "$3" bash -c 'exec 3<>"/dev/tcp/$1/$2"' bash "$1" "$2" 2>&1
  echo "rc $?"
}

# read_packages PACKAGE...
read_packages() {
  section packages
  # shellcheck disable=SC2016 # dpkg-query's own ${...} fields
  dpkg-query -W -f='${Package} ${db:Status-Abbrev} ${Version}\n' "$@" 2>/dev/null
}

# read_files FILE...: a missing file is not listed.
read_files() {
  section files
  sha256sum "$@" 2>/dev/null
}

# True where the docker CLI stands in for Docker's API: a host without curl.
no_curl() {
  ! command -v curl >/dev/null && command -v docker >/dev/null
}

read_images() {
  section images
  no_curl && $t docker images --digests --no-trunc --format '{{.Repository}}|{{.Tag}}|{{.Digest}}' 2>/dev/null
}

# read_model MODEL_DIR MARKER_FILE: the top-level files and hf's partial downloads (one find), the shards the index
# names (one awk) and the verified marker's first line.
read_model() {
  section model
  [ -d "$1" ] || return 0
  cd "$1" || return 0
  find . \( -path '*huggingface/download*' -name '*.incomplete' -printf 'incomplete %p\n' \) -o \
    \( -path './*' ! -path './*/*' -type f -printf '%f %s\n' \) 2>/dev/null
  [ -f model.safetensors.index.json ] && awk '{ while (match($0, /"[^"]*\.safetensors"/)) {
    s[substr($0, RSTART + 1, RLENGTH - 2)] = 1; $0 = substr($0, RSTART + RLENGTH) } }
    END { for (n in s) print "shard " n }' model.safetensors.index.json
  [ -f "$2" ] && sed -n '1s/^/checked /p' "$2"
  cd /
}

# read_dirs DIR...
read_dirs() {
  section dirs
  stat -c '%U %G %a %n' "$@" 2>/dev/null
}

# read_units UNIT SYSTEMCTL_SHOW_ARGS...: systemd's view of docker.service and UNIT in one call, then the first line
# of the unit file systemd loaded (the last FragmentPath: UNIT's).
read_units() {
  unit=$1
  shift
  section units
  sd=$($t systemctl show "$@" docker.service "$unit" 2>/dev/null)
  printf '%s\n' "$sd"
  section service_unit
  f=${sd##*FragmentPath=}
  f=${f%%"$nl"*}
  l=
  if [ -n "$f" ]; then
    { IFS= read -r l <"$f"; } 2>/dev/null
    printf 'FirstLine=%s\n' "$l"
  fi
}

# read_running UNIT_FILE LABEL: the pins in the unit file's header; the labelled containers come from Docker's API
# in read_http (the CLI only without curl).
read_running() {
  section running
  h=
  { read -r h; IFS= read -r h; } <"$1" 2>/dev/null
  printf 'Header=%s\n' "$h"
  no_curl && $t docker ps --no-trunc --filter "label=$2" --format "Container={{.Label \"$2\"}}|{{.Image}}" 2>/dev/null
}

# find_container CONTAINERS_PATH: $cj, the labelled containers as Docker's API lists them, and $cip, the first one's
# IPv4 address (none with host networking).
find_container() {
  cj=
  cip=
  command -v curl >/dev/null || return 0
  cj=$(curl -fs --max-time "$timeout_s" --noproxy '*' --unix-socket "$socket" "http://localhost$1" 2>/dev/null)
  cip=$(printf '%s' "$cj" | sed -n 's/.*"IPAddress":"\([0-9][0-9.]*[0-9]\)".*/\1/p' | head -n 1)
}

# The API key's header, only for a running labelled container. printf is a builtin: the key never reaches a
# command line.
api_key_header() {
  VLLM_API_KEY=
  # shellcheck source=/dev/null
  [ -f "$env_file" ] && . "$env_file"
  case "$cj" in *'"Id"'*) ;; *) VLLM_API_KEY= ;; esac
  if [ -n "$VLLM_API_KEY" ]; then printf 'Authorization: Bearer %s\n' "$VLLM_API_KEY"; fi
}

# One curl for every HTTP read, each --next its own request; -w prints the next section's marker after each. The key
# requests come first, each only where its keyring is missing: curl's arguments are built back to front, so each
# key's -w names the section that follows it ($n).
http_reads() {
  n=docker_images
  set --
  if [ -n "$docker_repo_url" ] && [ ! -f "$docker_keyring" ]; then
    ID=
    # shellcheck source=/dev/null
    . /etc/os-release
    set -- -fsSL --max-time 15 "$docker_repo_url/$ID/gpg" -w "\n$marker$n\n" --next "$@"
    n=docker_key
  fi
  if [ ! -f "$nvidia_keyring" ]; then
    set -- -fsSL --max-time 15 "$nvidia_key_url" -w "\n$marker$n\n" --next "$@"
    n=nvidia_key
  fi
  [ "$n" = nvidia_key ] || section "$n"
  curl "$@" -fs --max-time "$timeout_s" --noproxy '*' --unix-socket "$socket" http://localhost/images/json \
    -w "\n${marker}docker_containers $label\n" \
    --next -fs --max-time "$timeout_s" --noproxy '*' --unix-socket "$socket" "http://localhost$containers" \
    -w "\n${marker}health\n" \
    --next -s --max-time 3 -o /dev/null -w '%{http_code}\n' "http://$svc:$port/health" \
    --next -s --max-time 3 -H @- "http://$svc:$port/v1/models" -w "\n${marker}cache_config\n" \
    --next -s --max-time 3 "http://$svc:$port/metrics"
}

# read_http ENV_FILE ADDRESS PORT LABEL CONTAINERS_PATH CACHE_CONFIG NVIDIA_KEYRING NVIDIA_KEY_URL DOCKER_KEYRING
# DOCKER_REPO_URL: the repo keys (a keyring '' means fetch anyway), Docker's images and labelled containers, the
# server's health, models and cache config lines. The server is read at the container's own address ($cip), else
# at ADDRESS.
read_http() {
  env_file=$1
  svc=${cip:-$2}
  port=$3
  label=$4
  containers=$5
  nvidia_keyring=$7
  nvidia_key_url=$8
  docker_keyring=$9
  docker_repo_url=${10}
  section nvidia_key
  command -v curl >/dev/null || return 0
  api_key_header | http_reads 2>/dev/null |
    awk -v start="${marker}cache_config" -v keep="$6{" '$0 == start { c = 1; print; next } !c || index($0, keep) == 1'
}
