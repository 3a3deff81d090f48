"""deploy/ checked offline: every Kubernetes manifest validated strictly with kubernetes-validate
for the oldest and newest Kubernetes versions the installed package ships (the sidecar shape from
the first version with native sidecars), our own invariants (security settings, container order,
probe wiring, UIDs, ConfigMap references, the proxy's arguments as `egress-proxy run` reads them),
the Containerfile, and every nftables rule set we render checked by `nft -c` in a network
namespace of its own (nothing is applied to this machine)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from proxy.app.config import load_config
from proxy.boundary.nft.chains import DEFAULT_TABLE
from proxy.boundary.nft.compare import expected_chains
from proxy.boundary.nft.pod_rules import pod_ruleset
from proxy.boundary.nft.sandbox_rules import sandbox_ruleset
from proxy.boundary.probes.spec import parse_spec
from proxy.cli import build_parser
from proxy.cli import main as cli_main
from proxy.common.errors import ProxyError
from proxy.tls.bundle import BUNDLE_NAME, CA_NAME, trust_environment

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
NFT, UNSHARE = shutil.which("nft"), shutil.which("unshare")
# Native sidecars (an init container with restartPolicy: Always) are on by default from 1.29.
SIDECAR_FLOOR = (1, 29)

# -- loading ---------------------------------------------------------------------------------


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifest_files() -> list[Path]:
    return sorted(KUBERNETES.rglob("*.yaml"))


def shape_documents(shape: str) -> list[dict[str, Any]]:
    return [doc for path in sorted((KUBERNETES / shape).glob("*.yaml")) for doc in documents(path)]


def one(docs: list[dict[str, Any]], kind: str, **labels: str) -> dict[str, Any]:
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and all(d["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"expected one {kind} with {labels}, found {len(found)}"
    return found[0]


def version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def shipped_versions() -> list[str]:
    """The Kubernetes versions ("1.29.0") whose schemas the installed kubernetes-validate
    ships, oldest first."""
    versions = sorted(set(kubernetes_validate.utils.all_versions()), key=version_key)
    assert versions, "kubernetes-validate ships no schemas"
    return versions


def versions_for(path: Path) -> list[str]:
    """Oldest and newest shipped version this shape supports."""
    versions = shipped_versions()
    if "sidecar" in path.parts:
        versions = [v for v in versions if version_key(v)[:2] >= SIDECAR_FLOOR]
        assert versions, f"kubernetes-validate ships nothing at or after {SIDECAR_FLOOR}"
    return sorted({versions[0], versions[-1]}, key=version_key)


# -- schema validation -----------------------------------------------------------------------


def test_there_are_manifests_for_both_shapes() -> None:
    shapes = {path.parent.name for path in manifest_files()}
    assert shapes == {"sidecar", "gateway"}


@pytest.mark.parametrize(
    ("path", "version"),
    [
        pytest.param(path, version, id=f"{path.relative_to(KUBERNETES)}@{version}")
        for path in manifest_files()
        for version in versions_for(path)
    ],
)
def test_manifests_validate_strictly(path: Path, version: str) -> None:
    docs = documents(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_catches_an_unknown_field() -> None:
    # The check above can fail: a misspelt field in the agent's securityContext is refused.
    pod = one(shape_documents("sidecar"), "Pod")
    broken = json.loads(json.dumps(pod))
    broken["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalaton"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, shipped_versions()[-1], strict=True)


def test_the_sidecar_schema_floor_is_needed() -> None:
    # Before native sidecars the schema has no restartPolicy for an init container: the floor
    # is not arbitrary (and when the package stops shipping such versions, this says so).
    older = [v for v in shipped_versions() if version_key(v)[:2] < SIDECAR_FLOOR]
    if not older:
        pytest.skip("kubernetes-validate ships no version before native sidecars any more")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(one(shape_documents("sidecar"), "Pod"), older[0], True)


# -- helpers for the invariants ---------------------------------------------------------------


def options(args: list[str]) -> dict[str, list[str]]:
    """`--name=value` and `--name value` arguments, by name (repeats kept in order)."""
    found: dict[str, list[str]] = {}
    index = 0
    while index < len(args):
        arg = args[index]
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            if not sep and index + 1 < len(args) and not args[index + 1].startswith("--"):
                index += 1
                value = args[index]
            found.setdefault(name, []).append(value)
        index += 1
    return found


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def security(container: dict[str, Any]) -> dict[str, Any]:
    return container.get("securityContext") or {}


def all_containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def assert_locked_down(container: dict[str, Any]) -> None:
    """Non-root, no capability, no escalation."""
    sc = security(container)
    name = container["name"]
    assert sc.get("runAsNonRoot") is True, name
    assert isinstance(sc.get("runAsUser"), int) and sc["runAsUser"] > 0, name
    assert sc.get("allowPrivilegeEscalation") is False, name
    assert sc.get("privileged") in (None, False), name
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], name
    assert not sc.get("capabilities", {}).get("add"), name


def assert_pod_isolated(spec: dict[str, Any]) -> None:
    for field in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"):
        assert spec.get(field) in (None, False), field
    assert spec.get("automountServiceAccountToken") is False
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"


def assert_probes_on_admin(container: dict[str, Any], admin_port: int) -> None:
    """startupProbe on /readyz of the admin port (by name or number), as `--admin` binds it."""
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    probe = container["startupProbe"]["httpGet"]
    assert probe["path"] == "/readyz"
    assert ports.get(probe["port"], probe["port"]) == admin_port
    for kind, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[kind]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == admin_port


def assert_config_maps_exist(docs: list[dict[str, Any]], spec: dict[str, Any]) -> None:
    """Every ConfigMap volume names a ConfigMap of this shape, and every file the proxy is given
    under a mount is a key of that ConfigMap."""
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    volumes = {v["name"]: v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
    assert volumes
    for name in volumes.values():
        assert name in maps, f"ConfigMap {name} is referenced but not defined"
    for container in all_containers(spec):
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        for arg in container.get("args", []):
            path = arg.partition("=")[2] if arg.startswith("--") else arg
            directory, _, key = path.rpartition("/")
            if directory in mounts:
                config_map = maps[volumes[mounts[directory]]]
                assert key in config_map["data"], f"{path}: no key {key} in {config_map}"


def parse_run(args: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    """The proxy's arguments as the real `egress-proxy run` parser reads them."""
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        raise AssertionError(capsys.readouterr().err) from None


def check_with_cli(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    """The ConfigMaps' manifest, ceiling and config pass `egress-proxy check` together."""
    files = {}
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            for key, text in doc["data"].items():
                (tmp_path / key).write_text(text)
                files[key] = tmp_path / key
    code = cli_main(
        [
            "check",
            str(files["agent.yaml"]),
            "--ceiling",
            str(files["ceiling.yaml"]),
            "--config",
            str(files["config.yaml"]),
        ]
    )
    assert code == 0


# -- the sidecar shape -------------------------------------------------------------------------


def test_sidecar_pod_activates_in_order_with_least_privilege(tmp_path: Path) -> None:
    docs = shape_documents("sidecar")
    pod = one(docs, "Pod")
    spec = pod["spec"]
    assert_pod_isolated(spec)
    init = {c["name"]: c for c in spec["initContainers"]}
    assert list(init) == ["boundary-apply", "egress-proxy", "boundary-verify"]
    assert [c["name"] for c in spec["containers"]] == ["agent"]
    apply, proxy, verify = init.values()
    agent = spec["containers"][0]

    # boundary-apply: UID 0 with NET_ADMIN and nothing else.
    sc = security(apply)
    assert sc["runAsUser"] == 0
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert sc["allowPrivilegeEscalation"] is False and sc.get("privileged") in (None, False)
    assert apply["args"][:2] == ["boundary", "apply"]
    applied = options(apply["args"])
    assert "--print" not in applied

    # Every other container: non-root, no capability at all.
    for container in (proxy, verify, agent):
        assert_locked_down(container)
    proxy_uid = security(proxy)["runAsUser"]
    agent_uid = security(agent)["runAsUser"]
    assert proxy_uid != agent_uid
    assert int(applied["--proxy-uid"][0]) == proxy_uid
    assert security(verify)["runAsUser"] == agent_uid  # verify probes as the agent
    assert security(verify)["runAsGroup"] == security(agent)["runAsGroup"]
    net_admin = [
        c["name"]
        for c in all_containers(spec)
        if "NET_ADMIN" in security(c).get("capabilities", {}).get("add", [])
    ]
    assert net_admin == ["boundary-apply"]

    # The proxy: a native sidecar, its startupProbe on /readyz of the admin port it binds.
    assert proxy.get("restartPolicy") == "Always"
    assert proxy["args"][0] == "run"
    run = options(proxy["args"])
    admin_port = port_of(run["--admin"][0])
    assert_probes_on_admin(proxy, admin_port)
    assert int(applied["--admin-port"][0]) == admin_port

    # The ports the rules redirect to are the ones the proxy listens on, v4 and v6.
    transparent = int(applied["--transparent-port"][0])
    dns_port = int(applied["--dns-port"][0])
    explicit = int(applied["--explicit-port"][0])
    assert set(run["--listen"]) == {
        f"transparent://127.0.0.1:{transparent}",
        f"transparent://[::1]:{transparent}",
        f"http://127.0.0.1:{explicit}",
    }
    assert set(run["--dns-listen"]) == {f"127.0.0.1:{dns_port}", f"[::1]:{dns_port}"}

    # verify: the explicit port it checks is the proxy's; the agent's proxy variables name it.
    assert verify["args"][:2] == ["boundary", "verify"]
    assert int(options(verify["args"])["--proxy-port"][0]) == explicit
    env = {e["name"]: e.get("value") for e in agent["env"]}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[name] == f"http://127.0.0.1:{explicit}"

    # The arguments are what the real command line accepts.
    assert build_parser().parse_args(apply["args"]).proxy_uid == proxy_uid
    assert build_parser().parse_args(verify["args"]).proxy_port == explicit
    assert_config_maps_exist(docs, spec)
    check_with_cli(docs, tmp_path)


def test_sidecar_agent_trusts_the_published_bundle_and_never_sees_the_key() -> None:
    docs = shape_documents("sidecar")
    spec = one(docs, "Pod")["spec"]
    proxy = {c["name"]: c for c in spec["initContainers"]}["egress-proxy"]
    agent = spec["containers"][0]
    config = load_config(
        next(d["data"]["config.yaml"] for d in docs if "config.yaml" in d.get("data", {}))
    )
    assert config.operator.inspection_enabled and config.trust_dir is not None
    volumes = {v["name"]: v for v in spec["volumes"]}

    def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {m["mountPath"]: m for m in container.get("volumeMounts", [])}

    # The proxy writes the bundle where the agent reads it, read-only.
    published = mounts(proxy)[config.trust_dir]
    read = mounts(agent)[config.trust_dir]
    assert published["name"] == read["name"] and "emptyDir" in volumes[read["name"]]
    assert read.get("readOnly") is True and not published.get("readOnly")
    # The CA directory is below a volume only the proxy mounts (the mount point itself is
    # world-writable, which ensure_ca refuses): the agent has no mount of it at all.
    ca_mounts = [path for path in mounts(proxy) if config.ca_dir.startswith(path + "/")]
    assert len(ca_mounts) == 1
    ca_volume = mounts(proxy)[ca_mounts[0]]["name"]
    assert volumes[ca_volume]["emptyDir"].get("medium") == "Memory"
    for container in all_containers(spec):
        if container is not proxy:
            assert ca_volume not in {m["name"] for m in container.get("volumeMounts", [])}
    # Every trust variable, naming the file egress-proxy publishes under that name.
    env = {e["name"]: e.get("value") for e in agent["env"]}
    expected = trust_environment(
        f"{config.trust_dir}/{BUNDLE_NAME}", f"{config.trust_dir}/{CA_NAME}"
    )
    assert {name: env.get(name) for name in expected} == expected


def test_sidecar_network_policy_selects_the_pod() -> None:
    docs = shape_documents("sidecar")
    pod = one(docs, "Pod")
    policy = one(docs, "NetworkPolicy")["spec"]
    labels = pod["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    blocks = [
        peer["ipBlock"]
        for rule in policy["egress"]
        for peer in rule.get("to", [])
        if "ipBlock" in peer
    ]
    # The metadata endpoint is never reachable, even without the rules.
    assert all("169.254.0.0/16" in b.get("except", []) for b in blocks if b["cidr"] == "0.0.0.0/0")


def test_sidecar_rules_render_from_the_init_container_arguments(tmp_path: Path) -> None:
    apply = one(shape_documents("sidecar"), "Pod")["spec"]["initContainers"][0]
    printed = tmp_path / "out.txt"
    with printed.open("w") as out:
        assert cli_main([*apply["args"], "--print"], out=out) == 0
    text = printed.read_text()
    chains = expected_chains(text, DEFAULT_TABLE)
    assert set(chains) == {"nat_output", "filter_output", "filter_input"}
    assert chains["filter_output"].policy == "drop" and chains["filter_input"].policy == "drop"
    nft_check(text)


@pytest.mark.parametrize("shape", ["sidecar", "gateway"])
def test_proxy_arguments_are_what_egress_proxy_run_accepts(
    shape: str, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = shape_documents(shape)
    pods = [d["spec"] for d in docs if d["kind"] == "Pod"]
    pods += [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
    runs = [c["args"] for p in pods for c in all_containers(p) if c.get("args", [""])[0] == "run"]
    assert len(runs) == 1
    parsed = parse_run(runs[0], capsys)
    assert parsed.command == "run" and parsed.listen


# -- the gateway shape -------------------------------------------------------------------------


def test_gateway_agent_pod_has_no_capability_and_reaches_only_its_gateway(tmp_path: Path) -> None:
    docs = shape_documents("gateway")
    agent = one(docs, "Pod", **{"egress-proxy/role": "agent"})
    deployment = one(docs, "Deployment", **{"egress-proxy/role": "gateway"})
    service = one(docs, "Service")
    session = agent["metadata"]["labels"]["egress-proxy/session"]
    assert deployment["metadata"]["labels"]["egress-proxy/session"] == session

    # No NET_ADMIN (no capability at all) anywhere in the agent pod.
    spec = agent["spec"]
    assert_pod_isolated(spec)
    for container in all_containers(spec):
        assert_locked_down(container)
    text = yaml.safe_dump(agent)
    assert "NET_ADMIN" not in text and "NET_RAW" not in text

    # The gateway: the proxy, non-root, probes on its admin port, a Service in front.
    template = deployment["spec"]["template"]
    gateway_labels = template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= gateway_labels.items()
    assert_pod_isolated(template["spec"])
    (proxy,) = template["spec"]["containers"]
    assert_locked_down(proxy)
    assert security(proxy)["runAsUser"] != security(spec["containers"][0])["runAsUser"]
    run = options(proxy["args"])
    assert_probes_on_admin(proxy, port_of(run["--admin"][0]))
    proxy_port = port_of(run["--listen"][0])
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    assert service["spec"]["selector"].items() <= gateway_labels.items()
    (service_port,) = service["spec"]["ports"]
    assert ports[service_port["targetPort"]] == proxy_port
    assert_config_maps_exist(docs, template["spec"])
    check_with_cli(docs, tmp_path)

    # The agent names its gateway through the Service's environment variables (it has no DNS).
    assert spec.get("enableServiceLinks") is True
    prefix = re.sub(r"[^A-Z0-9]", "_", service["metadata"]["name"].upper())
    expected = f"http://$({prefix}_SERVICE_HOST):$({prefix}_SERVICE_PORT)"
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[name] == expected
    # The init container's probe spec is one `python -m proxy.probes` accepts.
    (ready,) = spec["initContainers"]
    assert ready["command"] == ["python", "-m", "proxy.probes"]
    spec_text = options(ready["args"])["--spec"][0]
    assert f"$({prefix}_SERVICE_HOST)" in spec_text
    probe = parse_spec(json.loads(spec_text.replace(f"$({prefix}_SERVICE_HOST)", "10.0.0.1")))
    assert probe.tcp[0].port == service_port["port"]


def test_gateway_network_policies_confine_the_agent() -> None:
    docs = shape_documents("gateway")
    agent = one(docs, "Pod", **{"egress-proxy/role": "agent"})
    gateway = one(docs, "Deployment")["spec"]["template"]
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy"]

    def selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
        return policy["podSelector"]["matchLabels"].items() <= labels.items()

    (agent_policy,) = [p for p in policies if selects(p, agent["metadata"]["labels"])]
    assert set(agent_policy["policyTypes"]) == {"Ingress", "Egress"}
    assert not agent_policy.get("ingress")
    (rule,) = agent_policy["egress"]  # one way out
    (peer,) = rule["to"]
    assert set(peer) == {"podSelector"}  # no ipBlock, no namespace: only the gateway pod
    assert peer["podSelector"]["matchLabels"].items() <= gateway["metadata"]["labels"].items()
    assert not peer["podSelector"]["matchLabels"].items() <= agent["metadata"]["labels"].items()
    proxy_port = port_of(options(gateway["spec"]["containers"][0]["args"])["--listen"][0])
    assert rule["ports"] == [{"protocol": "TCP", "port": proxy_port}]

    (gateway_policy,) = [p for p in policies if selects(p, gateway["metadata"]["labels"])]
    to_proxy = [
        r
        for r in gateway_policy["ingress"]
        if {"protocol": "TCP", "port": proxy_port} in r["ports"]
    ]
    (allowed,) = to_proxy
    (source,) = allowed["from"]
    assert source["podSelector"]["matchLabels"].items() <= agent["metadata"]["labels"].items()


# -- the Containerfile -------------------------------------------------------------------------


def containerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Containerfile").read_text())
    steps = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            steps.append((instruction.upper(), rest.strip()))
    return steps


def test_containerfile_runs_as_the_proxy_uid_with_nftables() -> None:
    steps = containerfile()
    users = [rest for instruction, rest in steps if instruction == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, f"USER {users[-1]} is not a numeric non-root UID"
    assert not gid or (gid.isdigit() and int(gid) > 0)
    runs = [rest for instruction, rest in steps if instruction == "RUN"]
    installs = [shlex.split(r) for r in runs if "apt-get install" in r]
    assert any("nftables" in words for words in installs), "nftables is not installed"
    assert any("scripts/install-wheel" in r for r in runs), "the package is not installed"
    assert any(f"--uid {uid}" in r for r in runs), "the USER is not created in the image"
    (entrypoint,) = [rest for instruction, rest in steps if instruction == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["egress-proxy"]
    # The sidecar's rules exempt exactly the image's user, which the proxy container runs as.
    pod = one(shape_documents("sidecar"), "Pod")
    apply = pod["spec"]["initContainers"][0]
    assert options(apply["args"])["--proxy-uid"] == [uid]


# -- nftables rule sets ------------------------------------------------------------------------


def nft_check(text: str) -> subprocess.CompletedProcess[str]:
    """`nft -c -f -` in a network namespace of its own (a user namespace too when not root), so
    nothing is applied to this machine. Fails the test when nft refuses the text."""
    done = nft_check_raw(text)
    assert done.returncode == 0, done.stderr
    return done


def nft_check_raw(text: str) -> subprocess.CompletedProcess[str]:
    if NFT is None or UNSHARE is None:
        pytest.skip("needs nftables (nft) and util-linux (unshare)")
    isolate = [UNSHARE, "-n"] if os.geteuid() == 0 else [UNSHARE, "-rn"]
    done = subprocess.run(
        [*isolate, NFT, "-c", "-f", "-"], input=text, capture_output=True, text=True, timeout=60
    )
    if (
        done.returncode != 0
        and "unshare" in done.stderr
        and "Operation not permitted" in done.stderr
    ):
        pytest.skip(f"cannot create a namespace here: {done.stderr.strip()}")
    return done


RULESET_VARIANTS = [
    {"proxy_uid": 10000, "transparent_port": 15001, "dns_port": 15053},
    {"proxy_uid": 10000, "transparent_port": 15001, "dns_port": 15053, "explicit_port": 3128},
    {
        "proxy_uid": 1,
        "transparent_port": 1,
        "dns_port": 65535,
        "explicit_port": 65534,
        "admin_port": 2,
    },
    {"proxy_uid": 4294967294, "transparent_port": 80, "dns_port": 5353, "table": "other_table"},
]


@pytest.mark.parametrize("variant", RULESET_VARIANTS)
def test_rendered_rule_sets_pass_nft_check(variant: dict[str, Any]) -> None:
    text = pod_ruleset(**variant)
    nft_check(text)
    table = variant.get("table", DEFAULT_TABLE)
    chains = expected_chains(text, table)
    nat = chains["nat_output"].rules
    assert nat[0].skuid == variant["proxy_uid"] and nat[0].verdict == "return"
    assert nat[-1].redirect_port == variant["transparent_port"]
    assert any(r.redirect_port == variant["dns_port"] and r.dports == {53} for r in nat)


@pytest.mark.parametrize(
    ("host4", "host6"), [("169.254.240.1", "fd12:3456:789a:1::1"), ("198.51.100.1", "fd00::1")]
)
def test_sandbox_rule_sets_pass_nft_check(host4: str, host6: str) -> None:
    # The one-machine shape's host-side rules: checked by nft itself, like the pod's.
    text = sandbox_ruleset(
        "egress_sb_0123abcd",
        "egsb0123abcdh",
        host4,
        host6,
        explicit_port=3128,
        transparent_port=15001,
        dns_port=15053,
    )
    nft_check(text)
    chains = expected_chains(text, "egress_sb_0123abcd")
    assert set(chains) == {"prerouting", "input", "forward"}
    # Everything that came in over the veth and was not accepted is dropped, never forwarded.
    assert chains["input"].rules[-1].verdict == "drop"
    assert [r.verdict for r in chains["forward"].rules] == ["drop", "drop"]


def test_nft_check_refuses_a_broken_rule_set() -> None:
    # The check above can fail: a redirect in a filter chain is refused by nft.
    text = pod_ruleset(10000, 15001, 15053).replace(
        "ct direction reply accept", "redirect to :15001"
    )
    assert nft_check_raw(text).returncode != 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"proxy_uid": 0}, "non-root UID"),
        ({"proxy_uid": -1}, "non-root UID"),
        ({"proxy_uid": 2**32 - 1}, "non-root UID"),
        ({"proxy_uid": True}, "non-root UID"),
        ({"proxy_uid": "10000"}, "non-root UID"),
        ({"transparent_port": 0}, "port number"),
        ({"dns_port": 65536}, "port number"),
        ({"dns_port": 53}, "must not be 53"),
        ({"explicit_port": 15001}, "both 15001"),
        ({"admin_port": 15001}, "both 15001"),
        ({"explicit_port": 15053}, "both 15053"),
        ({"table": "bad-name"}, "table name"),
        ({"table": "x" * 40}, "table name"),
        ({"table": 'a"; flush ruleset'}, "table name"),
    ],
)
def test_pod_ruleset_refuses_bad_input(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"proxy_uid": 10000, "transparent_port": 15001, "dns_port": 15053}
    with pytest.raises(ProxyError) as caught:
        pod_ruleset(**(arguments | kwargs))
    assert caught.value.reason == "invalid_boundary"
    assert message in caught.value.message


def test_boundary_apply_print_renders_and_refuses_bad_input(tmp_path: Path) -> None:
    base = ["boundary", "apply", "--transparent-port", "15001", "--dns-port", "15053"]
    command = [sys.executable, "-m", "proxy", *base, "--proxy-uid", "10000", "--print"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == pod_ruleset(10000, 15001, 15053)
    for bad in (
        ["--proxy-uid", "0"],
        ["--proxy-uid", "x"],
        ["--proxy-uid", "1", "--dns-port", "53"],
        ["--proxy-uid", "²"],
        ["--proxy-uid", "1", "--dns-port", "١٥٠٥٣"],
        ["--proxy-uid", "1", "--explicit-port", "9" * 5000],
    ):
        command = [sys.executable, "-m", "proxy", *base, *bad, "--print"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 2, (bad, done.stderr)
        assert "Traceback" not in done.stderr and done.stdout == ""


# -- read-back comparison on a real kernel table ---------------------------------------------------

_READ_BACK = """
import json, subprocess, sys
from proxy.boundary.nft.compare import compare_chains, expected_chains
from proxy.boundary.nft.load import read_back
text, other = sys.argv[1], sys.argv[2]
subprocess.run(["nft", "-f", "-"], input=text, text=True, check=True)
loaded = read_back("egress_boundary")
print(json.dumps({
    "same": compare_chains(expected_chains(text, "egress_boundary"), loaded),
    "other": compare_chains(expected_chains(other, "egress_boundary"), loaded),
}))
"""


def test_read_back_matches_what_was_rendered_and_notices_differences() -> None:
    if NFT is None or UNSHARE is None:
        pytest.skip("needs nftables (nft) and util-linux (unshare)")
    text = pod_ruleset(10000, 15001, 15053, 3128, admin_port=9901)
    other = pod_ruleset(10001, 15002, 15053, admin_port=9901)
    isolate = [UNSHARE, "-n"] if os.geteuid() == 0 else [UNSHARE, "-rn"]
    done = subprocess.run(
        [*isolate, sys.executable, "-c", _READ_BACK, text, other],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"cannot create a namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["same"] == []
    differences = "\n".join(result["other"])
    assert "chain nat_output: 5 rules loaded, 3 rendered" in differences  # no explicit port
    assert "chain filter_output rule 1" in differences  # the exempt UID


def test_sidecar_ask_token_is_the_proxys_alone() -> None:
    """The token that answers asks (run --ask) is in a volume only the proxy mounts: the agent
    shares the pod's network namespace and reaches the admin port, never the token."""
    spec = one(shape_documents("sidecar"), "Pod")["spec"]
    proxy = {c["name"]: c for c in spec["initContainers"]}["egress-proxy"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["ask-token"]["emptyDir"].get("medium") == "Memory"
    (mount,) = [m for m in proxy["volumeMounts"] if m["name"] == "ask-token"]
    text = (ROOT / "deploy" / "kubernetes" / "sidecar" / "pod.yaml").read_text()
    assert f"--ask-token={mount['mountPath']}/token" in text
    for container in all_containers(spec):
        if container is not proxy:
            assert "ask-token" not in {m["name"] for m in container.get("volumeMounts", [])}
