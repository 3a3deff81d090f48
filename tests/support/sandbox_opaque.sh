#!/usr/bin/env bash
# COMMAND of tests/test_opaque_sandbox.py: OpenSSH, git over SSH, psql and redis-cli inside
# `egress-proxy sandbox` with no proxy settings, so each connection takes the transparent
# redirect and is attributed by the session's DNS answers. One line per attempt:
#     NAME rc=N [key=value ...]       (stderr of each attempt in WORK/NAME.err)
#
#     sandbox_opaque.sh WORK KEY SSH_PORT REPO PSQL PG_PORT REDIS_PORT HOST4 TLS_PORT
set -u
work=$1 key=$2 ssh_port=$3 repo=$4 psql=$5 pg_port=$6 redis_port=$7 host4=$8 tls_port=$9
unset HTTP_PROXY HTTPS_PROXY http_proxy https_proxy ALL_PROXY all_proxy NO_PROXY no_proxy
export HOME=$work GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1
ssh_opts=(-i "$key" -F /dev/null -o "UserKnownHostsFile=$work/known_hosts"
    -o StrictHostKeyChecking=no -o BatchMode=yes -o IdentitiesOnly=yes -o ConnectTimeout=15
    -o LogLevel=ERROR)
squash() { tr -s ' \n\r\t' '____' <"$1" | cut -c1-300; }

# First, before any name is resolved: an address the session never got from its DNS.
ssh "${ssh_opts[@]}" -p "$ssh_port" "root@$host4" echo ok >"$work/ssh_address.out" 2>"$work/ssh_address.err"
echo "ssh_address rc=$? out=$(squash "$work/ssh_address.out") err=$(squash "$work/ssh_address.err")"

ssh "${ssh_opts[@]}" -p "$ssh_port" root@git.test echo ok >"$work/ssh.out" 2>"$work/ssh.err"
echo "ssh rc=$? out=$(squash "$work/ssh.out") err=$(squash "$work/ssh.err")"

GIT_SSH_COMMAND="ssh ${ssh_opts[*]}" git clone -q "ssh://root@git.test:$ssh_port$repo" \
    "$work/clone" >"$work/git.out" 2>"$work/git.err"
echo "git rc=$? readme=$(tr ' \n' '__' <"$work/clone/README" 2>/dev/null) err=$(squash "$work/git.err")"

PGCONNECT_TIMEOUT=15 PGSSLMODE=disable "$psql" -X -A -t -h db.test -p "$pg_port" -U postgres \
    -d postgres -c 'select 40 + 2' >"$work/psql.out" 2>"$work/psql.err"
echo "psql rc=$? out=$(squash "$work/psql.out") err=$(squash "$work/psql.err")"

timeout 20 redis-cli -h cache.test -p "$redis_port" PING >"$work/redis.out" 2>"$work/redis.err"
echo "redis rc=$? out=$(squash "$work/redis.out") err=$(squash "$work/redis.err")"

# TLS is still decided on its SNI: a name the manifest does not allow, to an attributed address.
curl -sS -k --max-time 15 --resolve "denied.test:$tls_port:$host4" \
    "https://denied.test:$tls_port/" -o /dev/null 2>"$work/tls_denied.err"
echo "tls_denied rc=$? err=$(squash "$work/tls_denied.err")"
echo "done rc=0"
