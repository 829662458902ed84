"""Host patterns: the forms users write, and what each one matches."""

from __future__ import annotations

import pytest

from otel_session._hosts import NOWHERE, HostPattern, HostRules, Route, parse_patterns
from otel_session._routers import BUILTIN, DYNAMO


def dynamo_rules(patterns: list[str], trusted: list[str] | None = None) -> HostRules:
    return HostRules([(DYNAMO, p) for p in parse_patterns(patterns)], parse_patterns(trusted or []))


CASES = [
    # pattern, (scheme, host, port) -> matches?
    ("dynamo", ("http", "dynamo", None), True),
    ("dynamo", ("https", "dynamo", 8443), True),
    ("dynamo", ("http", "DYNAMO.", 8000), True),
    ("Dynamo.Internal.", ("http", "dynamo.internal", 1), True),
    ("dynamo", ("http", "dynamo.evil.com", None), False),
    ("dynamo", ("http", "xdynamo", None), False),
    ("dynamo:8000", ("http", "dynamo", 8000), True),
    ("dynamo:8000", ("http", "dynamo", 8001), False),
    ("dynamo:80", ("http", "dynamo", None), True),  # the scheme's default port counts as that port
    ("dynamo:443", ("http", "dynamo", None), False),
    ("dynamo:443", ("https", "dynamo", None), True),
    ("*.svc.cluster.local", ("http", "a.svc.cluster.local", 8000), True),
    ("*.svc.cluster.local", ("http", "a.b.c.svc.cluster.local", 8000), True),
    ("*.svc.cluster.local", ("http", "svc.cluster.local", 8000), False),
    ("*.svc.cluster.local", ("http", "evilsvc.cluster.local", 8000), False),
    ("*.svc.cluster.local:8000", ("http", "a.svc.cluster.local", 9000), False),
    ("10.1.2.3", ("http", "10.1.2.3", 5), True),
    ("10.1.2.3:8000", ("http", "10.1.2.3", 8000), True),
    ("[::1]:8000", ("http", "::1", 8000), True),
    ("[::1]", ("http", "::1", 1), True),
    ("::1", ("http", "0:0:0:0:0:0:0:1", 1), True),
    ("[::1]:8000", ("http", "::1", 8001), False),
    ("http://dynamo-frontend:8000/v1", ("http", "dynamo-frontend", 8000), True),
    ("http://dynamo-frontend:8000/v1", ("http", "dynamo-frontend", 9000), False),
    ("http://dynamo-frontend/v1", ("http", "dynamo-frontend", 80), True),  # a URL means its port
    ("http://dynamo-frontend/v1", ("http", "dynamo-frontend", None), True),
    ("http://dynamo-frontend/v1", ("http", "dynamo-frontend", 9000), False),
    # host:port/path, as a base URL without its scheme is often written: the path says nothing here.
    ("dynamo-frontend:8000/v1", ("http", "dynamo-frontend", 8000), True),
    ("dynamo-frontend:8000/v1", ("http", "dynamo-frontend", 9000), False),
    ("dynamo-frontend/v1", ("https", "dynamo-frontend", 8443), True),
    ("https://dynamo", ("https", "dynamo", None), True),
    ("https://dynamo", ("https", "dynamo", 443), True),
    # A URL pattern keeps its scheme: a plain-http downgrade to the same host never matches.
    ("https://dynamo.internal/v1", ("http", "dynamo.internal", 443), False),
    ("https://dynamo.internal/v1", ("http", "dynamo.internal", None), False),
    ("https://dynamo.internal/v1", ("http", "dynamo.internal", 8000), False),
    ("https://dynamo.internal/v1", ("wss", "dynamo.internal", None), True),
    ("https://dynamo.internal:8443/v1", ("https", "dynamo.internal", 8443), True),
    ("https://dynamo.internal:8443/v1", ("http", "dynamo.internal", 8443), False),
    ("http://*.svc.local:8000", ("http", "a.svc.local", 8000), True),
    ("http://*.svc.local:8000", ("https", "a.svc.local", 8000), False),
    # Without a scheme: any scheme, the port as written or any port.
    ("dynamo.internal", ("https", "dynamo.internal", None), True),
    ("dynamo.internal:8000", ("https", "dynamo.internal", 8000), True),
    ("dynamo.internal:8000", ("http", "dynamo.internal", 8000), True),
    ("b\u00fccher.example", ("http", "xn--bcher-kva.example", None), True),
    ("stra\u00dfe.example", ("http", "xn--strae-oqa.example", None), True),  # IDNA 2008, as clients
    ("stra\u00dfe.example", ("http", "strasse.example", None), False),  # IDNA 2003 would say True
    ("strasse.example", ("http", "stra\u00dfe.example", None), False),
]


@pytest.mark.parametrize(("pattern", "destination", "expected"), CASES)
def test_pattern_matching(pattern: str, destination: tuple[str, str, int | None], expected: bool) -> None:
    rules = dynamo_rules([pattern])
    assert (rules.route(*destination) == Route(DYNAMO)) is expected


@pytest.mark.parametrize(
    "bad",
    [
        "",
        " ",
        "*",
        "*.",
        "a*.b",
        "*.*.b",
        "dyn amo",
        "dynamo:",
        "dynamo:0",
        "dynamo:65536",
        "dynamo:http",
        "[::1",
        "[::1]x",
        "http://user@dynamo",
        "ftp://dynamo",
        "http://",
        "*.10.0.0.1",
        "-bad-.com",
    ],
)
def test_malformed_patterns_are_value_errors_naming_the_pattern(bad: str) -> None:
    with pytest.raises(ValueError, match="host pattern"):
        HostPattern.parse(bad)


def test_environment_list_ignores_blanks_and_whitespace() -> None:
    assert parse_patterns(" a , ,b:1,, ") == (HostPattern("a"), HostPattern("b", 1))


def test_a_host_can_be_dynamo_and_trusted() -> None:
    rules = dynamo_rules(["both"], ["both", "gym"])
    assert rules.route("http", "both", None) == Route(DYNAMO, trusted=True)
    assert rules.route("http", "gym", None) == Route(None, trusted=True)
    assert rules.route("http", "else", None) is NOWHERE
    assert rules.route("http", None, None) is NOWHERE
    assert not NOWHERE


def test_one_profile_per_destination_the_narrower_pattern_wins() -> None:
    vllm, smg = BUILTIN["vllm-router"], BUILTIN["smg"]
    patterns = parse_patterns(["*.internal", "api.internal:8000", "api.internal"])
    rules = HostRules([(vllm, patterns[0]), (smg, patterns[2]), (DYNAMO, patterns[1])])
    assert rules.route("http", "api.internal", 8000).profile is DYNAMO  # exact host and port
    assert rules.route("http", "api.internal", 9000).profile is smg  # exact host
    assert rules.route("http", "other.internal", 9000).profile is vllm  # wildcard
    tie = HostRules([(vllm, HostPattern("h")), (smg, HostPattern("h"))])
    assert tie.route("http", "h", None).profile is vllm  # between equals, the first configured


def test_unknown_schemes_never_match_a_pattern_that_names_one() -> None:
    rules = dynamo_rules(["http://dynamo:8000"])
    assert rules.route("ftp", "dynamo", 8000) is NOWHERE
    assert dynamo_rules(["dynamo:8000"]).route("ftp", "dynamo", 8000) == Route(DYNAMO)


def test_classification_cache_is_bounded() -> None:
    rules = dynamo_rules(["dynamo"])
    for i in range(10_000):
        rules.route("http", f"h{i}.example", 80)
    assert len(rules._cache) <= 4096
