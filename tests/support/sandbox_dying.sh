#!/usr/bin/env bash
# COMMAND of tests/test_sandbox.py's proxy-death case, run inside `egress-proxy sandbox` as an
# unprivileged user. The worst kind of agent: it ignores SIGTERM and leaves a background
# process behind. It makes one allowed request, says it is ready, waits for the test to kill
# the proxy, then tries the ways out again: each must be refused (nothing listens where the
# rules send it), never let through. The sandbox must then kill it (SIGKILL after its grace).
#
#     sandbox_dying.sh PORT CA HOST4 OBS_TCP4 DIR
set -u
port=$1 ca=$2 host4=$3 obs_tcp4=$4 dir=$5
trap '' TERM

curl_rc() {  # NAME CURL-ARGS...
    local name=$1
    shift
    local code
    code=$(curl -sS --max-time 5 --cacert "$ca" -o /dev/null -w '%{http_code}' "$@" 2>/dev/null)
    echo "$name rc=$? code=${code:-0}"
}

curl_rc before "https://allowed.test:$port/"
sleep 299.5 &  # left behind on purpose: the sandbox's teardown must kill it
touch "$dir/ready"
for _ in $(seq 1 400); do
    [ -e "$dir/killed" ] && break
    sleep 0.05
done
curl_rc after_explicit "https://allowed.test:$port/"
(
    unset HTTP_PROXY HTTPS_PROXY http_proxy https_proxy
    curl_rc after_transparent --resolve "allowed.test:$port:$host4" "https://allowed.test:$port/"
)
timeout 5 bash -c "exec 3<>/dev/tcp/$host4/$obs_tcp4" 2>/dev/null
echo "after_tcp_direct rc=$?"
echo "attempts_done rc=0"
sleep 30
echo "survived rc=0"
