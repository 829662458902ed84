"""Host patterns: the forms users write, and what each one matches."""

from __future__ import annotations

import pytest

from otel_session._hosts import NOWHERE, HostPattern, HostRules, Route, normalize_host, parse_patterns
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


# ---- pinned by the mutation run (scripts/mutate): each test below fails on a mutant that survived ----

LABEL63 = "a" * 63
NAME253 = ".".join([LABEL63, LABEL63, LABEL63, "b" * 61])  # the longest name DNS allows


def test_names_are_mapped_as_uts_46_maps_them() -> None:
    """Full-width letters and the ideographic full stop (U+3002) are the name a client dials."""
    rules = dynamo_rules(["\uff44\uff59\uff4e\uff41\uff4d\uff4f.internal"])  # full-width "dynamo"
    for host in ("dynamo.internal", "DYNAMO.internal.", "dynamo\u3002internal", "\uff24ynamo\u3002internal"):
        assert rules.route("http", host, None) == Route(DYNAMO), host
    assert dynamo_rules(["dynamo\u3002internal"]).route("http", "dynamo.internal", None) == Route(DYNAMO)
    assert normalize_host("\uff44\uff59\uff4e\uff41\uff4d\uff4f\u3002internal") == "dynamo.internal"


def test_a_name_is_at_most_253_bytes() -> None:
    assert len(NAME253) == 253
    assert normalize_host(NAME253) == NAME253
    assert normalize_host(NAME253.upper() + ".") == NAME253
    assert normalize_host("c" + NAME253) is None
    assert dynamo_rules([NAME253]).route("http", NAME253, None) == Route(DYNAMO)
    wildcard = dynamo_rules(["*.internal"])
    under = ".".join([LABEL63, LABEL63, LABEL63])
    assert wildcard.route("http", f"{under}.{'c' * 52}.internal", 1) == Route(DYNAMO)  # 253 bytes
    assert wildcard.route("http", f"{under}.{'c' * 53}.internal", 1) is NOWHERE  # 254


@pytest.mark.parametrize("host", ["[::1", "::1]", "[::1]]", "[dynamo]", "[]", "", "a..b", "-a.b", "a_b-.c"])
def test_hosts_that_are_neither_a_name_nor_an_address(host: str) -> None:
    assert normalize_host(host) is None


@pytest.mark.parametrize(
    ("pattern", "parsed"),
    [
        ("[::1]:8000/v1", HostPattern("::1", 8000)),
        ("[::1]:8000/v1/[x]", HostPattern("::1", 8000)),
        ("dynamo:8000/v1/chat", HostPattern("dynamo", 8000)),
        ("dynamo:8000/2024/v1", HostPattern("dynamo", 8000)),  # a number in the path of a name
        ("10.1.2.3:8000/v1", HostPattern("10.1.2.3", 8000)),
        ("10.1.2.3/v1", HostPattern("10.1.2.3")),
        ("http://dynamo:1", HostPattern("dynamo", 1, scheme="http")),
        ("https://[::1]:8443/v1", HostPattern("::1", 8443, scheme="https")),
        ("wss://*.svc.local", HostPattern("svc.local", 443, wildcard=True, scheme="https")),
    ],
)
def test_patterns_copied_from_base_urls(pattern: str, parsed: HostPattern) -> None:
    assert HostPattern.parse(pattern) == parsed


NETWORK = "a network range is not a host pattern; name each address (or the hosts' DNS names, with a '*.' "
NEEDS_SCHEME = "a URL needs '://' (e.g. 'http://host:port')"
NO_PATH = "only a leading '*.' wildcard is allowed, and no path or userinfo"
FOR_NAMES = "would match IP addresses (name each address, or a whole network by its names)"
WILDCARD = "a '*.' wildcard is for DNS names;"
USERINFO = "a URL pattern must not contain user information"
NOT_HTTP = "expected an http(s) URL with a host"


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("http:/dynamo", NEEDS_SCHEME),
        ("https:dynamo", NEEDS_SCHEME),
        ("http//dynamo", NEEDS_SCHEME),
        ("//dynamo:8000", NEEDS_SCHEME),
        ("10.0.0.0/8", NETWORK + "wildcard)"),
        ("10/8", NETWORK + "wildcard)"),
        ("10.0.0.0/255.0.0.0", NETWORK + "wildcard)"),
        ("10.0.0.0/8/", NETWORK + "wildcard)"),
        ("[::1", "unclosed '[' in an IPv6 address"),
        ("[::1]]", "unexpected ']' after the address"),
        ("[::1]x", "unexpected 'x' after the address"),
        ("[::1]:x", "'x' is not a port number (1-65535)"),
        ("dynamo:0", "'0' is not a port number (1-65535)"),
        ("dynamo:65536", "'65536' is not a port number (1-65535)"),
        ("dyn@mo", NO_PATH),
        ("user@dynamo", NO_PATH),
        ("a*b", NO_PATH),
        ("[fe80::1/64]:80", NO_PATH),
        ("/v1", "'' is not a valid host name or IP address"),
        ("10", "'10' is not a valid host name or IP address"),
        ("192.168", "'192.168' is not a valid host name or IP address"),
        ("dyn amo", "'dyn amo' is not a valid host name or IP address"),
        ("*.0.5", f"{WILDCARD} '0.5' {FOR_NAMES}"),
        ("*.5", f"{WILDCARD} '5' {FOR_NAMES}"),
        ("*.::1", f"{WILDCARD} '::1' {FOR_NAMES}"),
        ("*.10.0.0.1", f"{WILDCARD} '10.0.0.1' {FOR_NAMES}"),
        ("http://[::1", "not a valid URL (Invalid IPv6 URL)"),
        ("http://dynamo:99999", "not a valid URL (Port out of range 0-65535)"),
        ("http://user:pw@dynamo", USERINFO),
        ("http://user@dynamo", USERINFO),
        ("ftp://dynamo", NOT_HTTP),
        ("http://", NOT_HTTP),
        ("http://*.10.0.0.1", f"host pattern '*.10.0.0.1': {WILDCARD} '10.0.0.1' {FOR_NAMES}"),
        ("http://dynamo:0", "host pattern 'dynamo:0': '0' is not a port number (1-65535)"),
    ],
)
def test_each_malformed_pattern_says_which_and_why(pattern: str, reason: str) -> None:
    with pytest.raises(ValueError) as raised:
        HostPattern.parse(pattern)
    assert str(raised.value) == f"host pattern {pattern!r}: {reason}"


@pytest.mark.parametrize("pattern", ["", " \t"])
def test_an_empty_pattern_says_so(pattern: str) -> None:
    with pytest.raises(ValueError) as raised:
        HostPattern.parse(pattern)
    assert str(raised.value) == "host pattern is empty"


@pytest.mark.parametrize("pattern", [42, None, b"dynamo"])
def test_a_pattern_that_is_no_str_is_a_type_error_naming_its_type(pattern: object) -> None:
    with pytest.raises(TypeError) as raised:
        HostPattern.parse(pattern)  # type: ignore[arg-type]
    assert str(raised.value) == f"host pattern must be a str, not {type(pattern).__name__}"


@pytest.mark.parametrize(
    ("pattern", "shown"),
    [
        ("Dynamo.", "dynamo"),
        ("dynamo:8000", "dynamo:8000"),
        ("*.corp:443", "*.corp:443"),
        ("*.corp", "*.corp"),
        ("::1", "[::1]"),
        ("[0:0::1]:8000", "[::1]:8000"),
        ("10.1.2.3", "10.1.2.3"),
        ("http://[::1]:8000/v1", "http://[::1]:8000"),
        ("https://dynamo", "https://dynamo:443"),
        ("ws://*.svc.local:81", "http://*.svc.local:81"),
    ],
)
def test_a_pattern_is_shown_in_a_form_it_parses_back_from(pattern: str, shown: str) -> None:
    parsed = HostPattern.parse(pattern)
    assert str(parsed) == shown
    assert HostPattern.parse(shown) == parsed


def test_the_rules_are_shown_by_profile() -> None:
    vllm = BUILTIN["vllm-router"]
    routes = [(DYNAMO, "dynamo:8000"), (vllm, "*.vllm"), (DYNAMO, "::1")]
    rules = HostRules(
        [(profile, HostPattern.parse(text)) for profile, text in routes],
        parse_patterns(["gym", "https://[::2]"]),
    )
    shown = f"routers: dynamo=[dynamo:8000, [::1]], {vllm.name}=[*.vllm]; trusted: [gym, https://[::2]:443]"
    assert repr(rules) == f"HostRules({shown})"
    assert repr(HostRules()) == "HostRules(routers: none; trusted: [])"


def test_rules_are_true_when_anything_is_configured() -> None:
    assert not HostRules()
    assert HostRules([(DYNAMO, HostPattern("d"))])
    assert HostRules(trusted=[HostPattern("t")])
    assert HostRules([(DYNAMO, HostPattern("d"))], [HostPattern("t")])


def test_a_trusted_pattern_keeps_its_scheme_and_port() -> None:
    rules = HostRules(trusted=parse_patterns(["https://gym", "tools:8000"]))
    assert rules.route("https", "gym", None) == Route(None, trusted=True)
    assert rules.route("http", "gym", 443) is NOWHERE  # a plain-http downgrade is not trusted
    assert rules.route("http", "tools", 8000) == Route(None, trusted=True)
    assert rules.route("http", "tools", 9000) is NOWHERE
    assert rules.route("http", "tools", None) is NOWHERE


def test_a_destination_is_classified_once() -> None:
    """The answer is kept per (scheme, host, port): the same route object every time."""
    rules = dynamo_rules(["dynamo"], ["gym"])
    first = rules.route("http", "dynamo", 8000)
    assert rules.route("http", "dynamo", 8000) is first
    assert rules.route("http", "gym", 1) is rules.route("http", "gym", 1)
    assert rules._cache[("http", "dynamo", 8000)] is first


def test_the_classification_cache_never_exceeds_its_bound() -> None:
    rules = dynamo_rules(["dynamo"])
    largest = 0
    for i in range(5_000):
        rules.route("http", f"h{i}.example", 80)
        largest = max(largest, len(rules._cache))
    assert largest == 4096
