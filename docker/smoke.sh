#!/usr/bin/env bash
# Smoke test of the compose stack (docker-compose.yml): build the image, start 2 shards, 3 workers (the
# scaled `worker` service), Prometheus and Grafana, wait until both shards are ready and training makes
# progress, scale the workers to 4 and see Prometheus find the fourth, print what was seen, and take
# everything down again (containers, network and volumes) however it ends.
#
# The stack's secrets come from .env (see .env.example) or the environment; where neither sets them, this
# script makes throwaway ones for its run.
#
# Needs: a running Docker engine with the compose plugin (`docker compose version`), network access to
# pull python:3.11-slim, prom/prometheus and grafana/grafana and to pip-install PyTorch (CPU wheels) and
# the package's dependencies, curl, and free host ports 3000, 7070, 7071, 8080, 8081 and 9090. About
# 3 GB of disk for the images. The first build takes several minutes (PyTorch).
#
#   docker/smoke.sh                 # from anywhere; exits 0 when the stack trains, non-zero otherwise
#   SMOKE_TIMEOUT=900 docker/smoke.sh
#   SMOKE_KEEP=1 docker/smoke.sh    # leave the stack running afterwards (docker compose down -v to stop)
#
# SMOKE_TIMEOUT (default 600) bounds the wait after `up`, in seconds; the build is not counted.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TIMEOUT="${SMOKE_TIMEOUT:-600}"
KEEP="${SMOKE_KEEP:-0}"
SHARD_URLS=("https://localhost:8080" "https://localhost:8081") # the run's CA and read token: from the stack
PROMETHEUS="http://localhost:9090"
GRAFANA="http://localhost:3000"

say() { printf '[smoke %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() {
    say "FAILED: $*" >&2
    exit 1
}

command -v docker >/dev/null 2>&1 || die "docker not found: this script needs a Docker engine with the compose plugin"
docker compose version >/dev/null 2>&1 || die "'docker compose' not available: install the Docker compose v2 plugin"
docker info >/dev/null 2>&1 || die "cannot reach the Docker engine (is it running, may this user use it?)"
command -v curl >/dev/null 2>&1 || die "curl not found: this script needs curl"

compose() { docker compose --project-directory "$ROOT" -f "$ROOT/docker-compose.yml" "$@"; }

# a secret for this run only, where neither the environment nor .env gives one
secret() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
for var in STREAMDILOCO_TOKEN GRAFANA_ADMIN_PASSWORD; do
    if [ -z "${!var:-}" ] && ! grep -qs "^$var=." "$ROOT/.env"; then
        export "$var=$(secret)"
        say "$var: not set in the environment or .env; using a throwaway one for this run"
    fi
done

STARTED=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$STARTED" = 1 ]; then
        if [ "$rc" != 0 ]; then
            say "state of the stack at the failure:"
            compose ps -a || true
            say "last log lines:"
            compose logs --no-color --tail 40 || true
        fi
        if [ "$KEEP" = 1 ]; then
            say "SMOKE_KEEP=1: leaving the stack up (stop it with: docker compose down -v)"
        else
            say "docker compose down -v"
            compose down -v --remove-orphans || true
        fi
    fi
    rm -f "$CA"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

CA="$(mktemp)" # the run's CA (the shards serve HTTPS), copied out of the stack once it is up
READ_TOKEN=""  # the shards' read token, likewise

# HTTP status code of a URL, 000 when nothing answers (shards: trusting the run's CA)
http_code() { curl -s -o /dev/null -m 5 --cacert "$CA" -w '%{http_code}' "$@" || true; }

# rounds_closed from a shard's /api/status (JSON), empty when it does not answer
rounds_closed() {
    curl -sf -m 5 --cacert "$CA" -H "Authorization: Bearer $READ_TOKEN" "$1/api/status" |
        grep -o '"rounds_closed": *[0-9]*' | grep -o '[0-9]*$' || true
}

# the value of a Prometheus instant query whose result is a single number, empty when there is none
prom_value() {
    curl -sf -m 5 "$PROMETHEUS/api/v1/query" --data-urlencode "query=$1" \
        | sed -n 's/.*"value":\[[^,]*,"\([^"]*\)"\].*/\1/p' || true
}

say "building the image (docker compose build)"
compose build
say "starting the stack (docker compose up -d)"
STARTED=1
compose up -d

deadline=$((SECONDS + TIMEOUT))
wait_for() { # wait_for DESCRIPTION COMMAND...: poll every 5 s until COMMAND succeeds or the deadline
    local what="$1"
    shift
    say "waiting for $what"
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || die "timed out after ${TIMEOUT}s waiting for $what"
        sleep 5
    done
}

shards_ready() {
    local u
    for u in "${SHARD_URLS[@]}"; do
        [ "$(http_code "$u/readyz")" = 200 ] || return 1
    done
}
compose exec -T shard-0 cat /certs/ca.pem >"$CA" # made by the certs service before any shard started
READ_TOKEN="$(compose exec -T shard-0 cat /certs/read.token)"
wait_for "both shards' /readyz to answer 200" shards_ready
say "shards ready: ${SHARD_URLS[*]} (/readyz 200, over TLS)"
code="$(http_code "${SHARD_URLS[0]}/api/status")"
[ "$code" = 401 ] || die "shard-0's /api/status without the read token answered $code, not 401"
say "shard-0's /api/status needs the read token (401 without it)"

first_rounds="$(rounds_closed "${SHARD_URLS[0]}")"
first_rounds="${first_rounds:-0}"
say "shard-0 rounds closed now: $first_rounds"

rounds_grew() {
    local n
    n="$(rounds_closed "${SHARD_URLS[0]}")"
    [ -n "$n" ] && [ "$n" -gt "$first_rounds" ]
}
wait_for "shard-0's rounds_closed (/api/status) to grow past $first_rounds" rounds_grew
say "shard-0 rounds closed: $(rounds_closed "${SHARD_URLS[0]}"); shard-1: $(rounds_closed "${SHARD_URLS[1]}")"

prom_rounds() {
    local v
    v="$(prom_value 'sum(streamdiloco_shard_rounds_total)')"
    [ -n "$v" ] && awk -v v="$v" 'BEGIN { exit !(v > 0) }'
}
wait_for "Prometheus to have scraped closed rounds (sum(streamdiloco_shard_rounds_total) > 0)" prom_rounds
say "Prometheus: sum(streamdiloco_shard_rounds_total) = $(prom_value 'sum(streamdiloco_shard_rounds_total)')"
say "Prometheus: shard targets up = $(prom_value 'sum(up{job="shards"})'), worker targets up = $(prom_value 'sum(up{job="workers"})')"
say "Prometheus: workers training = $(prom_value 'sum(streamdiloco_worker_phase{phase="training"})')"
say "Prometheus: tokens/s = $(prom_value 'sum(rate(streamdiloco_worker_tokens_total[1m]))')"
loss="$(prom_value 'avg(streamdiloco_shard_training_loss)')"
say "Prometheus: round mean training loss = ${loss:-none yet}"

workers_scraped() { # workers_scraped N: Prometheus scrapes N worker replicas (found through Docker's DNS)
    [ "$(prom_value 'count(up{job="workers"} == 1)')" = "$1" ]
}
wait_for "Prometheus to scrape the 3 worker replicas" workers_scraped 3
say "scaling the workers to 4 (docker compose up -d --scale worker=4)"
compose up -d --no-build --scale worker=4
wait_for "Prometheus to scrape the 4th worker replica" workers_scraped 4
say "Prometheus: worker replicas up = $(prom_value 'count(up{job="workers"} == 1)')"

grafana_has_dashboard() {
    [ "$(http_code "$GRAFANA/api/health")" = 200 ] &&
        [ "$(http_code "$GRAFANA/api/dashboards/uid/streamdiloco")" = 200 ]
}
wait_for "Grafana to serve the provisioned dashboard (uid streamdiloco)" grafana_has_dashboard
say "Grafana: $GRAFANA/d/streamdiloco answers (anonymous viewer)"

compose ps
say "OK: shards ready, rounds closing, workers scaling, Prometheus scraping, Grafana dashboard provisioned"
