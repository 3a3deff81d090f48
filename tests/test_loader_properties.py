"""No document, however strange, makes a loader raise anything but PolicyError."""

import contextlib
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from policy import PolicyError, compile_policy, load_ceiling, load_manifest

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


@settings(max_examples=400)
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


@settings(max_examples=200)
@given(documents)
def test_ceiling_loader_raises_only_policy_error(document: dict) -> None:
    with contextlib.suppress(PolicyError):
        load_ceiling(json.dumps(document), source="ceiling.json")
