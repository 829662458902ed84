"""Host patterns: the forms users write, and what each one matches."""

from __future__ import annotations

import pytest

from otel_session._hosts import DYNAMO, NOTHING, TRUSTED, HostPattern, HostRules, parse_patterns

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
    ("http://dynamo-frontend/v1", ("http", "dynamo-frontend", 9000), True),  # a URL without a port
    ("https://dynamo", ("https", "dynamo", None), True),
    ("b\u00fccher.example", ("http", "xn--bcher-kva.example", None), True),
    ("stra\u00dfe.example", ("http", "xn--strae-oqa.example", None), True),  # IDNA 2008, as clients
    ("stra\u00dfe.example", ("http", "strasse.example", None), False),  # IDNA 2003 would say True
    ("strasse.example", ("http", "stra\u00dfe.example", None), False),
]


@pytest.mark.parametrize(("pattern", "destination", "expected"), CASES)
def test_pattern_matching(pattern: str, destination: tuple[str, str, int | None], expected: bool) -> None:
    rules = HostRules(parse_patterns([pattern]))
    assert (rules.classify_url(*destination) == DYNAMO) is expected


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
        "a/b",
        "-bad-.com",
    ],
)
def test_malformed_patterns_are_value_errors_naming_the_pattern(bad: str) -> None:
    with pytest.raises(ValueError, match="host pattern"):
        HostPattern.parse(bad)


def test_environment_list_ignores_blanks_and_whitespace() -> None:
    assert parse_patterns(" a , ,b:1,, ") == (HostPattern("a"), HostPattern("b", 1))


def test_a_host_can_be_dynamo_and_trusted() -> None:
    rules = HostRules(parse_patterns(["both"]), parse_patterns(["both", "gym"]))
    assert rules.classify_url("http", "both", None) == DYNAMO | TRUSTED
    assert rules.classify_url("http", "gym", None) == TRUSTED
    assert rules.classify_url("http", "else", None) == NOTHING
    assert rules.classify_url("http", None, None) == NOTHING


def test_host_header_without_a_port_does_not_match_a_pattern_with_one() -> None:
    rules = HostRules(parse_patterns(["dynamo:443"]))
    assert rules.classify_authority("dynamo") == NOTHING  # scheme unknown: send nothing
    assert rules.classify_authority("dynamo:443") == DYNAMO
    assert rules.classify_authority("[::1]:443") == NOTHING
    assert rules.classify_authority("dynamo:99999") == NOTHING


def test_classification_cache_is_bounded() -> None:
    rules = HostRules(parse_patterns(["dynamo"]))
    for i in range(10_000):
        rules.classify(f"h{i}.example", 80)
    assert len(rules._cache) <= 4096
