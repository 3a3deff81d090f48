#!/usr/bin/env bash
# COMMAND of tests/test_sandbox.py, run by `egress-proxy sandbox` inside the session namespace as
# an unprivileged user (so only tools any user can run: bash, curl, getent, timeout). It takes
# the allowed way out and tries each bypass, printing one line per attempt:
#     NAME rc=N [key=value ...]
# Every address it aims at is the host side of the session's own veth (or a name the proxy
# resolves); nothing here can reach another machine.
#
#     sandbox_agent.sh PORT CA HOST4 HOST6 OBS_TCP4 OBS_TCP6 OBS_UDP4 OBS_UDP6
set -u
port=$1 ca=$2 host4=$3 host6=$4 obs_tcp4=$5 obs_tcp6=$6 obs_udp4=$7 obs_udp6=$8

curl_codes() {  # NAME CURL-ARGS...: curl's exit code, the response and CONNECT status codes
    local name=$1
    shift
    local out rc
    out=$(curl -sS --max-time 10 --cacert "$ca" -o /dev/null \
        -w '%{http_code} %{http_connect}' "$@" 2>/dev/null)
    rc=$?
    read -r code connect <<<"$out"
    echo "$name rc=$rc code=${code:-0} connect=${connect:-0}"
}

# The way out: the explicit proxy the sandbox names in HTTPS_PROXY.
echo "env https_proxy=${HTTPS_PROXY:-unset} no_proxy=${NO_PROXY-unset}"
curl_codes explicit_allowed "https://allowed.test:$port/"
curl_codes explicit_denied "https://denied.test:$port/"

# No proxy variables: the transparent redirect still decides, on the TLS SNI.
(
    unset HTTP_PROXY HTTPS_PROXY http_proxy https_proxy
    curl_codes transparent_allowed_v4 --resolve "allowed.test:$port:$host4" \
        "https://allowed.test:$port/"
    curl_codes transparent_allowed_v6 --resolve "allowed.test:$port:[$host6]" \
        "https://allowed.test:$port/"
    curl_codes transparent_denied --resolve "denied.test:$port:$host4" "https://denied.test:$port/"
)

# DNS through the namespace's resolv.conf: the proxy's responder.
answer=$(getent ahostsv4 allowed.test 2>/dev/null)
echo "dns_allowed rc=$? address=$(echo "${answer:-none}" | head -n 1 | cut -d ' ' -f 1)"
getent hosts denied.test >/dev/null 2>&1
echo "dns_denied rc=$?"

# Direct TCP to an address that is not the proxy's: the proxy must answer instead.
tcp_direct() {  # NAME HOST PORT
    local reply
    reply=$(timeout 5 bash -c "exec 3<>/dev/tcp/$2/$3 || exit 7
        printf 'GET / HTTP/1.1\r\nHost: direct.test\r\nConnection: close\r\n\r\n' >&3
        cat <&3" 2>/dev/null)
    local rc=$?
    local denied=0
    grep -qi '^x-egress-denied:' <<<"$reply" && denied=1
    echo "$1 rc=$rc proxy_denied=$denied"
}
tcp_direct tcp_direct_v4 "$host4" "$obs_tcp4"
tcp_direct tcp_direct_v6 "$host6" "$obs_tcp6"

# UDP: sent (the drop is on the host side), never echoed.
udp_echo() {  # NAME HOST PORT
    local reply=none
    exec 4<>"/dev/udp/$2/$3" || { echo "$1 rc=1 reply=none"; return; }
    printf 'udp-bypass' >&4
    read -r -t 1 -u 4 reply
    local rc=$?
    exec 4<&-
    echo "$1 rc=$rc reply=${reply:-none}"
}
udp_echo udp_v4 "$host4" "$obs_udp4"
udp_echo udp_v6 "$host6" "$obs_udp6"
echo "done rc=0"
