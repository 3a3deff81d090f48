#!/usr/bin/env bash
# COMMAND of tests/test_sandbox_clients.py: real tools inside `egress-proxy sandbox`, as an
# unprivileged user, with every proxy variable removed, so each connection takes the
# transparent redirect and is decided on its SNI or Host. The tools trust the session CA only
# through the variables the sandbox set. One line per attempt:  NAME rc=N [key=value ...]
#
#     sandbox_clients.sh TLS_PORT PLAIN_PORT WORKDIR CA_DIR
set -u
port=$1 plain_port=$2 work=$3 ca_dir=$4
unset HTTP_PROXY HTTPS_PROXY http_proxy https_proxy ALL_PROXY all_proxy NO_PROXY no_proxy

# What the sandbox gave COMMAND to trust, and that it cannot reach the CA's key.
echo "trust ssl_cert_file=${SSL_CERT_FILE:-unset} node=${NODE_EXTRA_CA_CERTS:-unset}" \
    "pip=${PIP_CERT:-unset} git=${GIT_SSL_CAINFO:-unset} curl=${CURL_CA_BUNDLE:-unset}" \
    "requests=${REQUESTS_CA_BUNDLE:-unset} npm=${npm_config_cafile:-unset}" \
    "files=$(ls "$(dirname "${SSL_CERT_FILE:-/nonexistent/x}")" 2>/dev/null | tr '\n' ',')"
cat "$ca_dir/mitmproxy-ca.pem" >/dev/null 2>&1
echo "read_key rc=$?"

curl_line() {  # NAME URL: curl's exit code, the status and the X-Egress-Denied reason
    local out rc
    out=$(curl -sS --max-time 20 -D - -o "$work/$1.body" -w '%{http_code}' "$2" 2>/dev/null)
    rc=$?
    local denied
    denied=$(grep -i '^x-egress-denied:' <<<"$out" | cut -d ' ' -f 2 | tr -d '\r')
    echo "$1 rc=$rc code=$(tail -n 1 <<<"$out") denied=${denied:-none}"
}
# An intercepted host (its rules are URL prefixes): our CA, trusted through CURL_CA_BUNDLE.
curl_line curl_index "https://pypi.test:$port/simple/tinypkg/"
curl_line curl_denied "https://pypi.test:$port/private/"
# A host allowed whole: its own certificate, which the bundle's system roots vouch for.
curl_line curl_passthrough "https://passthrough.test:$port/hello.txt"

# A credential's host: COMMAND holds only the placeholder, the proxy puts the secret in.
echo "env api_token=${API_TOKEN:-unset}"
out=$(curl -sS --max-time 20 -D - -o /dev/null -w '%{http_code}' \
    -H "Authorization: Bearer ${API_TOKEN:-none}" "https://api.test:$port/hello.txt" 2>/dev/null)
echo "api rc=$? code=$(tail -n 1 <<<"$out") denied=none"

python3 -m pip download --no-deps --no-cache-dir --disable-pip-version-check --quiet \
    -d "$work/dl" --index-url "https://pypi.test:$port/simple/" tinypkg >"$work/pip.log" 2>&1
echo "pip rc=$? files=$(ls "$work/dl" 2>/dev/null | tr '\n' ',')"

git clone --quiet "https://git.test:$port/repo.git" "$work/repo" >"$work/git.log" 2>&1
echo "git rc=$? readme=$(cat "$work/repo/README" 2>/dev/null | tr ' ' '_')"

# Node's built-in fetch ignores HTTPS_PROXY: only the redirect takes it anywhere.
node -e '
const [port, plainPort] = process.argv.slice(1);
const get = async (name, url) => {
  try {
    const r = await fetch(url);
    const body = (await r.text()).trim().replace(/\s+/g, "_");
    console.log(`${name} rc=0 code=${r.status} denied=${r.headers.get("x-egress-denied") || "none"} body=${body.slice(0, 200)}`);
  } catch (e) {
    console.log(`${name} rc=1 error=${String(e.cause || e).replace(/\s+/g, "_").slice(0, 200)}`);
  }
};
(async () => {
  await get("node_intercepted", `https://pypi.test:${port}/simple/tinypkg/`);
  await get("node_denied", `https://pypi.test:${port}/private/`);
  await get("node_plain", `http://plain.test:${plainPort}/hello.txt`);
})();
' "$port" "$plain_port" 2>"$work/node.log"
echo "done rc=0"
