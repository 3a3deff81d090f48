"""No document, however strange (its numbers of any size and spelling too), makes a loader
raise anything but PolicyError."""

import contextlib
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy import Manifest, PolicyError, compile_policy, load_ceiling, load_manifest
from proxy.app.config import load_config

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=30),
    st.sampled_from(
        [
            "github.com",
            "*.a.com",
            "https://a.com/x/",
            "10.0.0.0/8",
            "public",
            "allowlist",
            "169.254.169.254",
            "localhost",
            "Ä.com",
            "a..b",
            "",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(
            st.sampled_from(
                [
                    "network",
                    "egress",
                    "egress_mode",
                    "network_access",
                    "allowed",
                    "blocked",
                    "schema_version",
                    "access",
                    "github",
                    "repos",
                    "choose",
                    "tenant",
                    "x-a",
                    "other",
                ]
            ),
            inner,
            max_size=5,
        ),
    ),
    max_leaves=25,
)
documents = st.dictionaries(
    st.sampled_from(
        ["network", "network_access", "schema_version", "access", "name", "tenant", "egress"]
    ),
    values,
    max_size=4,
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(documents, st.sampled_from(["agent.json", "agent.yaml"]))
def test_manifest_loader_raises_only_policy_error(document: dict, source: str) -> None:
    text = json.dumps(document)  # JSON is YAML too
    try:
        manifest = load_manifest(text, source=source)
    except PolicyError:
        return
    for finding in manifest.findings:
        json.dumps(finding.to_json())  # always printable by `check --json`
    try:
        policy = compile_policy(manifest)
    except PolicyError as exc:
        assert exc.reason == "invalid_manifest"
        return
    assert isinstance(policy.decide("github.com:443").allowed, bool)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_ceiling_loader_raises_only_policy_error(document: dict) -> None:
    with contextlib.suppress(PolicyError):
        load_ceiling(json.dumps(document), source="ceiling.json")


# -- numbers of any size and spelling, in every syntax, through every loader -------------------

NUMBER_TEXTS = st.one_of(
    st.integers().map(str),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats().map(repr),  # nan, inf, -0.0, 1e+300
    st.integers(min_value=4280, max_value=4400).map(lambda n: "9" * n),
    st.from_regex(
        r"[-+]?(0x[0-9a-f_]{1,30}|0o[0-7_]{1,30}|0b[01_]{1,80}|0[0-7]{1,30}|[0-9_]{1,30}"
        r"(\.[0-9_]{0,5})?([eE][-+]?[0-9]{1,12})?|[1-9][0-9]?(:[0-5]?[0-9]){1,40})",
        fullmatch=True,
    ),
    st.sampled_from(
        [".inf", "-.inf", ".nan", ".NaN", "inf", "+inf", "nan", "NaN", "Infinity", "-Infinity",
         "1e400", "1.0e+400", "-0", "yes", "on", "off", "true", "null", "~", "0x", "1__0"]
    ),
)  # fmt: skip

# Where a number may stand, for each syntax: values the loaders read and values they do not.
NUMBER_PLACES = {
    "yaml": [
        "network:\n  egress: [github.com, {n}]\n",
        "network:\n  egress_mode: {n}\n  {n}: x\n",
        "schema_version: {n}\nnetwork_access:\n  blocked: ['10.0.0.0/{n}', {n}]\n",
        "tenant: {n}\negress: [{n}]\n",
        "ports: [{n}]\nlimits:\n  max_connections: {n}\n  idle_timeout: {n}\n",
        "dns:\n  nameservers: ['10.0.0.2:{n}']\n  timeout: {n}s\n",
        "platform_destinations:\n  - {{host: gw.example.net, ports: [{n}], cidrs: ['::/{n}']}}\n",
        "other: {{deep: [{n}, {{x: {n}}}]}}\n? {n}\n: {n}\n",
    ],
    "toml": [
        "schema_version = {n}\n[network_access]\nallowed = ['a.com', {n}]\n",
        "[network_access]\nblocked = ['10.0.0.0/{n}']\nother = {n}\n",
        "tenant = {n}\negress = [{n}]\n",
        "ports = [{n}]\n[limits]\nmax_connections = {n}\n",
        "[[platform_destinations]]\nhost = 'gw.example.net'\nports = [{n}]\n",
        "x = {{ y = [{n}, '{n}'] }}\n",
    ],
    "json": [
        '{{"network": {{"egress": [{n}], "egress_mode": {n}}}}}',
        '{{"schema_version": {n}, "network_access": {{"allowed": [{n}]}}}}',
        '{{"tenant": "t", "egress": [{n}]}}',
        '{{"ports": [{n}], "limits": {{"max_connections": {n}}}}}',
        '{{"dns": {{"timeout": {n}, "nameservers": ["10.0.0.2:{n}"]}}}}',
    ],
}
_NUMBER_REASONS = ("number_out_of_range", "number_not_finite")


LOADERS = {
    "agent": lambda text, source: load_manifest(text, source=source),
    "ceiling": lambda text, source: load_ceiling(text, source=source),
    "config": lambda text, source: load_config(text, source=source),
}


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(list(NUMBER_PLACES)),
    st.data(),
    NUMBER_TEXTS,
    st.sampled_from(list(LOADERS)),
)
def test_loaders_raise_only_policy_error_for_any_number(
    syntax: str, data: st.DataObject, number: str, loader: str
) -> None:
    place = data.draw(st.sampled_from(NUMBER_PLACES[syntax]))
    text = place.format(n=number)
    source = f"{loader}.{syntax}"
    try:
        result = LOADERS[loader](text, source)
    except PolicyError as exc:
        message = str(exc)
        assert len(message) < 3000, message[:200]
        assert "Exceeds the limit" not in message
        if exc.reason in _NUMBER_REASONS:
            # A number out of bounds is refused where it stands.
            assert exc.source == source and exc.line is not None and exc.column is not None
        for detail in exc.details:
            json.dumps(detail.to_json(), allow_nan=False)
            assert len(detail.message) < 1000
        return
    if isinstance(result, Manifest):
        for finding in result.findings:
            json.dumps(finding.to_json(), allow_nan=False)  # `check --json` stays strict JSON
            assert len(finding.message) < 1000 and len(finding.path) < 300
        with contextlib.suppress(PolicyError):
            compile_policy(result)
