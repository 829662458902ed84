"""The configuration's rules (``otel_session._settings``), in the fast tier and in-process: every
variable and argument, the spellings each accepts, its default, and each bad value's one error (in
code) or one warning line (zero-code mode, ``build(lenient=True)``), word for word.

``configure()`` itself (installing, repeat calls, what reaches a host) is ``tests/test_configure.py``;
here the settings are built with ``_settings.build()``, which ``configure()`` and zero-code mode call,
so each rule is judged in microseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction

import pytest

import otel_session
from otel_session import _environment, _settings
from otel_session._hosts import HostPattern, HostRules
from otel_session._routers import DYNAMO, profile_named
from otel_session._settings import (
    SettingError,
    Settings,
    build,
    flag,
    parse_bool,
    parse_bool_env,
    parse_routers,
)
from otel_session._siblings import Siblings

pytestmark = pytest.mark.usefixtures("clean_otel_env")

TAIL = ", the rest is delivered as usual"
BOOLEAN = "is not a boolean: use one of true/false, 1/0, yes/no, on/off"
NOTHING_SET = (
    "otel-session: no routers or trusted hosts configured, so no request will carry a session; pass "
    "dynamo_hosts=[...] or set OTEL_SESSION_DYNAMO_HOSTS (or OTEL_SESSION_ROUTERS)"
)
NOTHING_LEFT = (
    "otel-session: no router or trusted host is left once the entries above are left out, so no "
    "request will carry a session"
)
SIBLINGS_WORDS = "is not attempt, prompt, auto, fleet or groups:K (K from 1 to 4096, e.g. groups:2)"
ADOPT_HELP = (
    "is not understood, so no server-side session ID is adopted; use session:KEY (request.session[KEY], "
    "e.g. session:session_id for NeMo-Gym) or cookie:NAME"
)
ENTRY_HELP = (
    "is not module:Qualified.name[group=...] (e.g. my_rl.rollouts:Agent.run_episode, "
    "my_rl.rollouts:run_episode[group=uid])"
)


def routes_of(settings: Settings) -> list[tuple[str, str]]:
    return [(profile.name, str(pattern)) for profile, pattern in settings.rules.routes]


def trusted_of(settings: Settings) -> list[str]:
    return [str(pattern) for pattern in settings.rules.trusted]


def raised(**kwargs: object) -> SettingError:
    """The ``SettingError`` ``build(**kwargs)`` raises."""
    with pytest.raises(SettingError) as caught:
        build(**kwargs)  # type: ignore[arg-type]
    return caught.value


# ---- the defaults ---------------------------------------------------------------------------------


def test_a_settings_value_made_with_nothing_switches_nothing_on() -> None:
    settings = Settings()
    assert not settings.rules and settings.rules.routes == () and settings.rules.trusted == ()
    assert settings.tracing is False and settings.end_sessions is False and settings.servers is False
    assert settings.adopt is None and settings.trajectory_functions == ()
    assert settings.siblings == Siblings.parse("auto") and settings.strict_affinity is False


def test_with_no_variable_set_every_switch_is_off_and_one_line_says_nothing_will_carry() -> None:
    settings, warnings = build()
    assert settings == Settings(rules=settings.rules)
    assert not settings.rules
    assert warnings == [NOTHING_SET]
    settings, warnings = build(lenient=True)
    assert settings.servers is False and warnings == [NOTHING_SET]
    assert build(say_if_empty=False)[1] == []
    settings, warnings = build(lenient=True, servers_default=True)
    assert settings.servers is True and settings.tracing is False and settings.end_sessions is False


def test_a_configuration_with_a_host_says_nothing() -> None:
    assert build(dynamo_hosts="d:1")[1] == []
    assert build(trusted_hosts="gym:1")[1] == []
    assert build(routers={"smg": "gw:1"})[1] == []


# ---- each variable read when its argument is missing ------------------------------------------------


def test_every_variable_is_read_when_its_argument_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "dyn:1, ,dyn:2,")
    monkeypatch.setenv("OTEL_SESSION_TRUSTED_HOSTS", "gym:9000,,*.corp")
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", "vllm-router=vr:3")
    monkeypatch.setenv("OTEL_SESSION_TRACING", "yes")
    monkeypatch.setenv("OTEL_SESSION_END_SESSIONS", "1")
    monkeypatch.setenv("OTEL_SESSION_SERVERS", "on")
    monkeypatch.setenv("OTEL_SESSION_ADOPT", "session:session_id")
    monkeypatch.setenv("OTEL_SESSION_TRAJECTORY_FUNCTIONS", "m:f,n:C.g[group=uid]")
    monkeypatch.setenv("OTEL_SESSION_SIBLINGS", "groups:3")
    monkeypatch.setenv("OTEL_SESSION_STRICT_AFFINITY", "true")
    settings, warnings = build()
    assert warnings == []
    assert routes_of(settings) == [("dynamo", "dyn:1"), ("dynamo", "dyn:2"), ("vllm-router", "vr:3")]
    assert trusted_of(settings) == ["gym:9000", "*.corp"]
    assert settings.tracing is settings.end_sessions is settings.servers is settings.strict_affinity is True
    assert settings.adopt == ("session", "session_id")
    assert settings.trajectory_functions == ("m:f", "n:C.g[group=uid]")
    assert settings.siblings == Siblings(3)


def test_an_argument_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TRACING", "END_SESSIONS", "SERVERS", "STRICT_AFFINITY"):
        monkeypatch.setenv(f"OTEL_SESSION_{name}", "true")
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "env-d:1")
    monkeypatch.setenv("OTEL_SESSION_TRUSTED_HOSTS", "env-t:1")
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", "smg=env-r:1")
    monkeypatch.setenv("OTEL_SESSION_TRAJECTORY_FUNCTIONS", "env:f")
    monkeypatch.setenv("OTEL_SESSION_SIBLINGS", "prompt")
    settings, _ = build(
        dynamo_hosts=["arg-d:1"],
        trusted_hosts=["arg-t:1"],
        routers={"litellm": ["arg-r:1"]},
        tracing=False,
        end_sessions=False,
        servers=False,
        strict_affinity=False,
        trajectory_functions=["arg:f"],
        siblings="attempt",
    )
    assert routes_of(settings) == [("dynamo", "arg-d:1"), ("litellm", "arg-r:1")]
    assert trusted_of(settings) == ["arg-t:1"]
    assert not (settings.tracing or settings.end_sessions or settings.servers or settings.strict_affinity)
    assert settings.trajectory_functions == ("arg:f",)
    assert settings.siblings == Siblings(None)


# ---- booleans ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "means"),
    [
        ("true", True), ("1", True), ("yes", True), ("on", True), (" TRUE ", True), ("On", True),
        ("false", False), ("0", False), ("no", False), ("off", False), (" FALSE ", False), ("Off", False),
    ],
)  # fmt: skip
def test_each_boolean_spelling_reads_the_same_in_a_variable_and_an_argument(
    monkeypatch: pytest.MonkeyPatch, raw: str, means: bool
) -> None:
    assert parse_bool("X", raw) is means
    assert parse_bool("X", raw, default=not means) is means
    assert flag("tracing", raw, "OTEL_SESSION_TRACING", default=not means) is means
    monkeypatch.setenv("OTEL_SESSION_TRACING", raw)
    assert parse_bool_env("OTEL_SESSION_TRACING", default=not means) is means
    assert build(dynamo_hosts="d:1")[0].tracing is means


def test_an_unset_or_blank_variable_is_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_bool("X", None) is False
    assert parse_bool("X", None, True) is True
    assert parse_bool("X", "  ") is False and parse_bool("X", " \t", default=True) is True
    assert parse_bool_env("OTEL_SESSION_TRACING") is False
    assert parse_bool_env("OTEL_SESSION_TRACING", True) is True
    monkeypatch.setenv("OTEL_SESSION_TRACING", " ")
    assert parse_bool_env("OTEL_SESSION_TRACING") is False
    assert parse_bool_env("OTEL_SESSION_TRACING", True) is True
    assert flag("tracing", None, "OTEL_SESSION_TRACING") is False
    assert flag("tracing", None, "OTEL_SESSION_TRACING", True) is True


def test_a_blank_value_is_refused_where_blank_does_not_mean_unset() -> None:
    with pytest.raises(SettingError) as caught:
        parse_bool("X", " ", blank_is_unset=False)
    assert str(caught.value) == f"X=' ' {BOOLEAN}" and caught.value.name == "X"
    with pytest.raises(SettingError) as caught:
        flag("tracing", "", "OTEL_SESSION_TRACING")
    assert str(caught.value) == f"tracing='' {BOOLEAN}" and caught.value.name == "tracing"


def test_a_bad_boolean_is_one_error_naming_it_word_for_word() -> None:
    with pytest.raises(SettingError) as caught:
        parse_bool("OTEL_SESSION_SERVERS", "maybe")
    assert str(caught.value) == f"OTEL_SESSION_SERVERS='maybe' {BOOLEAN}"
    assert caught.value.name == "OTEL_SESSION_SERVERS" and isinstance(caught.value, ValueError)
    assert caught.value.args == (f"OTEL_SESSION_SERVERS='maybe' {BOOLEAN}",)


def test_a_switch_takes_a_bool_zero_or_one_and_nothing_else() -> None:
    assert flag("tracing", True, "OTEL_SESSION_TRACING") is True
    assert flag("tracing", False, "OTEL_SESSION_TRACING", True) is False
    assert flag("tracing", 1, "OTEL_SESSION_TRACING") is True
    assert flag("tracing", 0, "OTEL_SESSION_TRACING", True) is False
    for bad in (2, -1, 1.0, 0.0, [True], b"true"):
        with pytest.raises(SettingError) as caught:
            flag("servers", bad, "OTEL_SESSION_SERVERS")
        assert str(caught.value) == f"servers must be True, False or None, not {bad!r}"
        assert caught.value.name == "servers"


@pytest.mark.parametrize(
    ("variable", "argument", "meaning"),
    [
        ("OTEL_SESSION_TRACING", "tracing", "tracing stays off"),
        ("OTEL_SESSION_END_SESSIONS", "end_sessions", "sessions are not ended explicitly"),
        ("OTEL_SESSION_SERVERS", "servers", "servers are not instrumented"),
        (
            "OTEL_SESSION_STRICT_AFFINITY",
            "strict_affinity",
            "a session its router refuses for want of room goes on unpinned",
        ),
    ],
)
def test_a_bad_switch_variable_is_one_warning_and_off_in_zero_code_mode_and_an_error_in_code(
    monkeypatch: pytest.MonkeyPatch, variable: str, argument: str, meaning: str
) -> None:
    monkeypatch.setenv(variable, "maybe")
    settings, warnings = build(dynamo_hosts="d:1", lenient=True)
    assert warnings == [f"otel-session: {variable}='maybe' {BOOLEAN}; {meaning}{TAIL}"]
    assert getattr(settings, argument) is False
    assert settings.rules and routes_of(settings) == [("dynamo", "d:1")]
    error = raised(dynamo_hosts="d:1")
    assert error.name == variable and str(error) == f"{variable}='maybe' {BOOLEAN}"
    # an argument is never lenient: passed in code, it is the caller's to fix
    error = raised(dynamo_hosts="d:1", lenient=True, **{argument: "maybe"})
    assert error.name == argument and str(error) == f"{argument}='maybe' {BOOLEAN}"


def test_a_bad_servers_variable_keeps_servers_on_where_that_is_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_SESSION_SERVERS", "perhaps")
    settings, warnings = build(dynamo_hosts="d:1", lenient=True, servers_default=True)
    assert settings.servers is True
    assert warnings == [
        f"otel-session: OTEL_SESSION_SERVERS='perhaps' {BOOLEAN}; servers are instrumented{TAIL}"
    ]
    monkeypatch.setenv("OTEL_SESSION_SERVERS", "off")
    assert build(dynamo_hosts="d:1", lenient=True, servers_default=True)[0].servers is False


# ---- host patterns ----------------------------------------------------------------------------------


def test_patterns_are_read_from_a_string_or_a_list_blank_entries_skipped() -> None:
    settings, _ = build(dynamo_hosts=" d:1 ,, ,d:2", trusted_hosts=("t:1", "t:2"))
    assert routes_of(settings) == [("dynamo", "d:1"), ("dynamo", "d:2")]
    assert trusted_of(settings) == ["t:1", "t:2"]
    assert routes_of(build(dynamo_hosts=[])[0]) == []
    assert routes_of(build(dynamo_hosts="")[0]) == []  # given, though empty: the variable is not read


def test_an_empty_argument_still_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "env:1")
    monkeypatch.setenv("OTEL_SESSION_TRUSTED_HOSTS", "env:2")
    settings, warnings = build(dynamo_hosts=[], trusted_hosts="")
    assert not settings.rules and warnings == [NOTHING_SET]


def test_a_bad_pattern_argument_is_an_error_naming_the_argument_even_in_zero_code_mode() -> None:
    for lenient in (False, True):
        error = raised(dynamo_hosts=["ok:1", "bad host"], lenient=lenient)
        assert error.name == "dynamo_hosts"
        assert (
            str(error)
            == "dynamo_hosts: host pattern 'bad host': 'bad host' is not a valid host name or IP address"
        )
        error = raised(trusted_hosts="ok:1,x:99999", lenient=lenient)
        assert error.name == "trusted_hosts"
        assert str(error) == "trusted_hosts: host pattern 'x:99999': '99999' is not a port number (1-65535)"
    error = raised(dynamo_hosts=[5])
    assert (error.name, str(error)) == ("dynamo_hosts", "dynamo_hosts: host pattern must be a str, not int")


def test_a_pattern_list_that_is_no_list_is_an_error_naming_it() -> None:
    error = raised(dynamo_hosts=5)
    assert (error.name, str(error)) == ("dynamo_hosts", "dynamo_hosts must be a list of strings, not int")
    error = raised(trusted_hosts=None, routers={"smg": 7.5})
    assert (error.name, str(error)) == (
        "routers['smg']",
        "routers['smg'] must be a list of strings, not float",
    )


@pytest.mark.parametrize(
    ("variable", "reads"),
    [("OTEL_SESSION_DYNAMO_HOSTS", "routes"), ("OTEL_SESSION_TRUSTED_HOSTS", "trusted")],
)
def test_a_bad_variable_entry_is_left_out_with_one_warning_and_the_others_kept(
    monkeypatch: pytest.MonkeyPatch, variable: str, reads: str
) -> None:
    monkeypatch.setenv(variable, "good:1,bad host,also:2,h:0")
    settings, warnings = build(lenient=True)
    kept = routes_of(settings) if reads == "routes" else [("dynamo", p) for p in trusted_of(settings)]
    assert kept == [("dynamo", "good:1"), ("dynamo", "also:2")]
    assert warnings == [
        f"otel-session: {variable}: host pattern 'bad host': 'bad host' is not a valid host name or IP "
        f"address; that entry is left out{TAIL}",
        f"otel-session: {variable}: host pattern 'h:0': '0' is not a port number (1-65535); that entry is "
        f"left out{TAIL}",
    ]
    error = raised()  # in code, the variable's bad entry is an error naming the variable
    assert error.name == variable
    assert (
        str(error)
        == f"{variable}: host pattern 'bad host': 'bad host' is not a valid host name or IP address"
    )


@pytest.mark.parametrize(
    "variable", ["OTEL_SESSION_DYNAMO_HOSTS", "OTEL_SESSION_TRUSTED_HOSTS", "OTEL_SESSION_ROUTERS"]
)
def test_every_host_left_out_is_said_as_left_out_not_as_never_set(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, "smg=bad host" if variable.endswith("ROUTERS") else "bad host")
    settings, warnings = build(lenient=True)
    assert not settings.rules
    assert len(warnings) == 2 and warnings[-1] == NOTHING_LEFT and variable in warnings[0]
    assert build(lenient=True, say_if_empty=False)[1] == warnings[:1]


def test_a_bad_variable_that_is_not_a_host_still_says_nothing_was_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_SESSION_TRACING", "maybe")
    monkeypatch.setenv("OTEL_SESSION_SIBLINGS", "many")
    _, warnings = build(lenient=True)
    assert len(warnings) == 3 and warnings[-1] == NOTHING_SET


def test_a_dynamo_host_entry_with_an_equals_sign_gets_no_hint_about_routers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only ``OTEL_SESSION_ROUTERS`` has ``;`` between entries: a host list is told nothing of it."""
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "dynamo=d:1")
    _, warnings = build(lenient=True, say_if_empty=False)
    assert warnings == [
        "otel-session: OTEL_SESSION_DYNAMO_HOSTS: host pattern 'dynamo=d:1': 'dynamo=d' is not a valid host "
        f"name or IP address; that entry is left out{TAIL}"
    ]


def test_a_bad_host_variable_with_others_left_says_nothing_of_emptiness(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "bad host")
    monkeypatch.setenv("OTEL_SESSION_TRUSTED_HOSTS", "gym:1")
    settings, warnings = build(lenient=True)
    assert trusted_of(settings) == ["gym:1"] and len(warnings) == 1


def test_with_dynamo_hosts_adds_dynamo_routes_and_keeps_the_rest() -> None:
    settings, _ = build(dynamo_hosts="d:1", trusted_hosts="t:1", routers={"smg": "g:1"}, tracing=True)
    more = settings.with_dynamo_hosts([HostPattern.parse("d:2"), HostPattern.parse("d:3")])
    assert routes_of(more) == [("dynamo", "d:1"), ("smg", "g:1"), ("dynamo", "d:2"), ("dynamo", "d:3")]
    assert trusted_of(more) == ["t:1"] and more.tracing is True
    assert routes_of(settings) == [("dynamo", "d:1"), ("smg", "g:1")]  # the original unchanged
    assert all(profile is DYNAMO for profile, _ in more.rules.routes if profile.name == "dynamo")
    assert (
        routes_of(Settings().with_dynamo_hosts([])) == []
        and Settings().with_dynamo_hosts([]).rules.trusted == ()
    )


# ---- routers ----------------------------------------------------------------------------------------


def test_routers_given_in_code_by_profile() -> None:
    settings, warnings = build(
        routers={
            "vllm-router": ["vr:1", "vr:2"],
            " SMG ": "gw:1,gw:2",
            "header:X-Route": ("c:1",),
            "litellm": None,
        }
    )
    assert warnings == []
    assert routes_of(settings) == [
        ("vllm-router", "vr:1"),
        ("vllm-router", "vr:2"),
        ("smg", "gw:1"),
        ("smg", "gw:2"),
        ("header:X-Route", "c:1"),
    ]
    assert settings.rules.routes[0][0] is profile_named("vllm-router")


def test_routers_that_are_no_mapping_are_an_error() -> None:
    error = raised(routers=["smg=gw:1"])
    assert error.name == "routers"
    assert str(error) == "routers must be a mapping of profile -> patterns, not list"


def test_an_unknown_profile_in_code_is_an_error_naming_routers() -> None:
    for lenient in (False, True):
        error = raised(routers={"dynamo": "d:1", "nginx": "n:1"}, lenient=lenient)
        assert error.name == "routers"
        assert str(error) == (
            "routers: unknown router profile 'nginx': use one of dynamo, vllm-router, smg, litellm, "
            "or header:NAME"
        )
    error = raised(routers={3: "n:1"})
    assert (error.name, str(error)) == ("routers", "routers: router profile must be a str, not int")


def test_a_bad_pattern_of_a_router_in_code_names_its_profile() -> None:
    error = raised(routers={"vllm-router": ["ok:1", "vllm-router=x:1"]}, lenient=True)
    assert error.name == "routers"
    assert str(error) == (
        "routers['vllm-router']: host pattern 'vllm-router=x:1': 'vllm-router=x' is not a valid host name or "
        "IP address"
    )  # no hint about ';' here: a mapping has no separators to get wrong


def test_the_routers_variable_read_entry_by_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", " ; vllm-router = vr:1 ;smg=gw:1,gw:2;;vllm-router=vr:2; ")
    settings, warnings = build(lenient=True)
    assert warnings == []
    assert routes_of(settings) == [
        ("vllm-router", "vr:1"),
        ("vllm-router", "vr:2"),
        ("smg", "gw:1"),
        ("smg", "gw:2"),
    ]


def test_parse_routers_merges_a_profile_given_twice_and_reports_each_malformed_entry() -> None:
    assert parse_routers("") == ({}, [])
    assert parse_routers(" ; ;") == ({}, [])
    assert parse_routers(" smg =a:1; smg=b:2 ;x=c") == ({"smg": "a:1,b:2 ", "x": "c"}, [])
    routers, malformed = parse_routers("smg=a:1;garbage; =x:1;litellm= ;vllm-router")
    assert routers == {"smg": "a:1"}
    example = "(entries separated by ';', e.g. 'vllm-router=10.0.0.5:8000;smg=*.gateway.internal')"
    assert malformed == [
        f"OTEL_SESSION_ROUTERS: {entry!r} is not PROFILE=PATTERN[,PATTERN...] {example}"
        for entry in ("garbage", "=x:1", "litellm=", "vllm-router")
    ]


def test_a_malformed_routers_variable_entry_is_one_warning_in_zero_code_mode_and_an_error_in_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", "smg=gw:1;garbage")
    settings, warnings = build(lenient=True)
    assert routes_of(settings) == [("smg", "gw:1")]
    assert warnings == [
        "otel-session: OTEL_SESSION_ROUTERS: 'garbage' is not PROFILE=PATTERN[,PATTERN...] (entries "
        "separated "
        "by ';', e.g. 'vllm-router=10.0.0.5:8000;smg=*.gateway.internal'); that entry is left out" + TAIL
    ]
    error = raised()
    assert error.name == "OTEL_SESSION_ROUTERS" and str(error).startswith(
        "OTEL_SESSION_ROUTERS: 'garbage' is not"
    )


def test_an_unknown_profile_in_the_variable_is_left_out_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", "nginx=n:1;smg=gw:1")
    settings, warnings = build(lenient=True)
    assert routes_of(settings) == [("smg", "gw:1")]
    assert warnings == [
        "otel-session: OTEL_SESSION_ROUTERS: unknown router profile 'nginx': use one of dynamo, vllm-router, "
        "smg, litellm, or header:NAME; router 'nginx' is not configured" + TAIL
    ]
    error = raised()
    assert error.name == "OTEL_SESSION_ROUTERS"
    assert str(error) == (
        "OTEL_SESSION_ROUTERS: unknown router profile 'nginx': use one of dynamo, vllm-router, smg, litellm, "
        "or header:NAME"
    )


def test_a_bad_pattern_in_the_routers_variable_says_to_separate_routers_with_semicolons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", "vllm-router=vr:1,smg=gw:1,bad host")
    settings, warnings = build(lenient=True)
    assert routes_of(settings) == [("vllm-router", "vr:1")]
    assert warnings == [
        "otel-session: OTEL_SESSION_ROUTERS: vllm-router: host pattern 'smg=gw:1': 'smg=gw' is not a valid "
        "host name or IP address (separate routers with ';'); that entry is left out" + TAIL,
        "otel-session: OTEL_SESSION_ROUTERS: vllm-router: host pattern 'bad host': 'bad host' is not a valid "
        "host name or IP address; that entry is left out" + TAIL,
    ]
    error = raised()
    assert error.name == "OTEL_SESSION_ROUTERS"
    assert str(error) == (
        "OTEL_SESSION_ROUTERS: vllm-router: host pattern 'smg=gw:1': 'smg=gw' is not a valid host name or IP "
        "address (separate routers with ';')"
    )


def test_one_pattern_for_two_profiles_is_kept_by_the_first_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = raised(dynamo_hosts="gw:1", routers={"smg": ["gw:1"]})
    assert error.name == "routers"
    assert str(error) == (
        "routers: host pattern 'gw:1' is given to both dynamo and smg, but a destination gets one "
        "router's header"
    )
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "gw:1")
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", "smg=other:2,gw:1;litellm=gw:1")
    settings, warnings = build(lenient=True)
    assert routes_of(settings) == [("dynamo", "gw:1"), ("smg", "other:2")]
    assert settings.rules.route("http", "gw", 1).profile is DYNAMO
    assert warnings == [
        "otel-session: OTEL_SESSION_ROUTERS: host pattern 'gw:1' is given to both dynamo and smg, but a "
        f"destination gets one router's header; dynamo keeps it{TAIL}",
        "otel-session: OTEL_SESSION_ROUTERS: host pattern 'gw:1' is given to both dynamo and litellm, but a "
        f"destination gets one router's header; dynamo keeps it{TAIL}",
    ]
    error = raised()
    assert error.name == "OTEL_SESSION_ROUTERS"
    assert str(error) == (
        "OTEL_SESSION_ROUTERS: host pattern 'gw:1' is given to both dynamo and smg, but a destination "
        "gets one "
        "router's header"
    )


def test_one_pattern_given_twice_to_one_profile_is_kept_once_and_said_nothing() -> None:
    settings, warnings = build(dynamo_hosts="gw:1,gw:1", routers={"smg": "s:1,s:1"})
    assert routes_of(settings) == [("dynamo", "gw:1"), ("smg", "s:1")] and warnings == []


# ---- adopt ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "adopts"),
    [
        ("session:session_id", ("session", "session_id")),
        ("  Cookie : sid  ", ("cookie", "sid")),
        ("SESSION:Key.With-Dots", ("session", "Key.With-Dots")),
        ("cookie:a:b", ("cookie", "a:b")),
        ("cookie:XSRF-Token", ("cookie", "XSRF-Token")),
        ("", None),
        ("   ", None),
    ],
)
def test_adopt_reads_session_or_cookie_and_a_name(
    monkeypatch: pytest.MonkeyPatch, raw: str, adopts: tuple[str, str] | None
) -> None:
    monkeypatch.setenv("OTEL_SESSION_ADOPT", raw)
    settings, warnings = build(dynamo_hosts="d:1")
    assert settings.adopt == adopts and warnings == []


@pytest.mark.parametrize(
    "raw",
    ["session", "header:x", "session:", "cookie:  ", "session:a b", "cookie:a\tb", "cookie:a,b",
     "session:a;b",
     "cookie:a=b", ":x", "sessions:x", " :session"],
)  # fmt: skip
def test_a_bad_adopt_is_one_warning_and_adopts_nothing_even_in_code(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("OTEL_SESSION_ADOPT", raw)
    for lenient in (False, True):
        settings, warnings = build(dynamo_hosts="d:1", lenient=lenient)
        assert settings.adopt is None
        assert warnings == [f"otel-session: OTEL_SESSION_ADOPT={raw!r} {ADOPT_HELP}"]


# ---- siblings ---------------------------------------------------------------------------------------


def test_siblings_from_the_argument_or_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build(siblings="prompt")[0].siblings == Siblings(0)
    given = Siblings(5)
    assert build(siblings=given)[0].siblings is given
    monkeypatch.setenv("OTEL_SESSION_SIBLINGS", " Groups:7 ")
    assert build()[0].siblings == Siblings(7)
    monkeypatch.setenv("OTEL_SESSION_SIBLINGS", "  ")
    settings, warnings = build(dynamo_hosts="d:1")
    assert str(settings.siblings) == "auto" and warnings == []


def test_a_bad_siblings_argument_is_an_error_even_in_zero_code_mode() -> None:
    for lenient in (False, True):
        error = raised(siblings="many", lenient=lenient)
        assert (error.name, str(error)) == ("siblings", f"siblings: 'many' {SIBLINGS_WORDS}")
    error = raised(siblings="")  # passed, though blank: refused, not read as the default
    assert (error.name, str(error)) == ("siblings", f"siblings: '' {SIBLINGS_WORDS}")
    error = raised(siblings=2)
    assert (error.name, str(error)) == ("siblings", "siblings: must be a string such as 'groups:2', not int")


def test_a_bad_siblings_variable_keeps_the_default_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_SIBLINGS", "groups:0")
    settings, warnings = build(dynamo_hosts="d:1", lenient=True)
    assert str(settings.siblings) == "auto"
    assert warnings == [
        f"otel-session: OTEL_SESSION_SIBLINGS: 'groups:0' {SIBLINGS_WORDS}; siblings are keyed as auto{TAIL}"
    ]
    error = raised(dynamo_hosts="d:1")
    assert (error.name, str(error)) == (
        "OTEL_SESSION_SIBLINGS",
        f"OTEL_SESSION_SIBLINGS: 'groups:0' {SIBLINGS_WORDS}",
    )


# ---- trajectory functions ---------------------------------------------------------------------------


def test_trajectory_functions_from_a_string_or_a_list_each_once_in_order() -> None:
    settings, _ = build(trajectory_functions="b:g, a:f[group=uid] ,b:g,, c:h[group=x|before_last(,)]")
    assert settings.trajectory_functions == ("b:g", "a:f[group=uid]", "c:h[group=x|before_last(,)]")
    settings, _ = build(trajectory_functions=["a:f", "a:f", " z:C.m "])
    assert settings.trajectory_functions == ("a:f", "z:C.m")
    assert build(trajectory_functions=[])[0].trajectory_functions == ()


def test_a_bad_trajectory_function_argument_is_an_error_even_in_zero_code_mode() -> None:
    for lenient in (False, True):
        error = raised(trajectory_functions=["a:f", "bad"], lenient=lenient)
        assert (error.name, str(error)) == (
            "trajectory_functions",
            f"trajectory_functions: 'bad' {ENTRY_HELP}",
        )
    error = raised(trajectory_functions=["a:f", 5])
    assert (error.name, str(error)) == (
        "trajectory_functions",
        "trajectory_functions: 5 is not module:Qualified.name",
    )
    error = raised(trajectory_functions="a:f[grp=1]")
    assert (error.name, str(error)) == (
        "trajectory_functions",
        f"trajectory_functions: 'a:f[grp=1]' {ENTRY_HELP}",
    )
    error = raised(trajectory_functions=5)
    assert (error.name, str(error)) == (
        "trajectory_functions",
        "trajectory_functions must be a list of strings, not int",
    )


def test_a_bad_trajectory_functions_variable_entry_is_left_out_or_applied_without_its_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_SESSION_TRAJECTORY_FUNCTIONS", "a:f,bad,b:g[grp=1],c:h[group=uid]")
    settings, warnings = build(dynamo_hosts="d:1", lenient=True)
    assert settings.trajectory_functions == ("a:f", "b:g", "c:h[group=uid]")
    assert warnings == [
        f"otel-session: OTEL_SESSION_TRAJECTORY_FUNCTIONS: 'bad' {ENTRY_HELP}; that entry is left out{TAIL}",
        f"otel-session: OTEL_SESSION_TRAJECTORY_FUNCTIONS: 'b:g[grp=1]' {ENTRY_HELP}; b:g applies without a "
        f"group key{TAIL}",
    ]
    error = raised(dynamo_hosts="d:1")
    assert error.name == "OTEL_SESSION_TRAJECTORY_FUNCTIONS"
    assert str(error) == f"OTEL_SESSION_TRAJECTORY_FUNCTIONS: 'bad' {ENTRY_HELP}"


# ---- the configuration in force ---------------------------------------------------------------------


def test_configure_puts_its_settings_in_force_and_unconfigure_takes_them_away() -> None:
    assert _settings.current is None
    settings = otel_session.configure(dynamo_hosts="d:1")
    assert _settings.current is settings
    otel_session.unconfigure()
    assert _settings.current is None
    mine = Settings(HostRules())
    _settings.set_active(mine)
    try:
        assert _settings.current is mine
    finally:
        _settings.set_active(None)
    assert _settings.current is None


def test_zero_code_mode_logs_each_bad_variable_as_one_line_and_configures_the_rest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "d:1")
    monkeypatch.setenv("OTEL_SESSION_END_SESSIONS", "sometimes")
    monkeypatch.setenv("OTEL_SESSION_ADOPT", "cookie")
    with caplog.at_level(logging.WARNING, logger="otel_session"):
        _environment.configure_from_environment()
    lines = [record.getMessage() for record in caplog.records if record.name.startswith("otel_session")]
    assert lines == [
        f"otel-session: OTEL_SESSION_END_SESSIONS='sometimes' {BOOLEAN}; sessions are not ended "
        f"explicitly{TAIL}",
        f"otel-session: OTEL_SESSION_ADOPT='cookie' {ADOPT_HELP}",
    ]
    assert _settings.current is not None and routes_of(_settings.current) == [("dynamo", "d:1")]
    assert _settings.current.servers is True


@pytest.fixture(autouse=True)
def _nothing_in_force() -> Iterator[None]:
    yield
    _settings.set_active(None)


# ---- the pace between new parents ----------------------------------------------------------------

PACE_WORDS = "is not a number of milliseconds from 0 to 1000"


@pytest.mark.parametrize(
    ("given", "seconds"), [(None, None), (40, 0.04), (0, 0.0), (2.5, 0.0025), ("40", 0.04), (10, 0.01)]
)
def test_the_pace_is_read_in_milliseconds_from_its_argument(given: object, seconds: float | None) -> None:
    """Unset, ``None``: new parents paced by the burst (``_pacing.apart``); set, that pace, fixed."""
    settings, warnings = build(dynamo_hosts="d:1", pace_ms=given)
    assert settings.pace == (None if seconds is None else pytest.approx(seconds)) and warnings == []


@pytest.mark.parametrize(
    ("raw", "seconds"), [("40", 0.04), (" 1000 ", 1.0), ("0", 0.0), ("", None), ("  ", None)]
)
def test_the_pace_is_read_from_its_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str, seconds: float | None
) -> None:
    monkeypatch.setenv("OTEL_SESSION_PACE_MS", raw)
    assert build(dynamo_hosts="d:1")[0].pace == (None if seconds is None else pytest.approx(seconds))
    assert build(dynamo_hosts="d:1", pace_ms=20)[0].pace == pytest.approx(0.02)  # the argument wins


class _Floaty:
    def __float__(self) -> float:
        return 40.0


def test_a_pace_from_a_config_tool_is_read_whatever_kind_of_number_it_is() -> None:
    """numpy's integers and floats (Hydra and OmegaConf hand them on), ``Decimal`` and ``Fraction``."""
    import numpy

    for given in (numpy.int64(40), numpy.int32(40), numpy.float32(40), Decimal("40"), Fraction(80, 2)):
        assert build(dynamo_hosts="d:1", pace_ms=given)[0].pace == pytest.approx(0.04), given


@pytest.mark.parametrize(
    "bad",
    [-1, 1000.5, 5000, "x", "nan", "inf", True, [40], b"40", 40j, Decimal("NaN"), Decimal("sNaN"), _Floaty()],
)
def test_a_bad_pace_argument_is_an_error_naming_it(bad: object) -> None:
    error = raised(dynamo_hosts="d:1", pace_ms=bad, lenient=True)  # an argument is never lenient
    assert error.name == "pace_ms" and str(error) == f"pace_ms: {bad!r} {PACE_WORDS}"


@pytest.mark.parametrize("bad", ["-1", "1001", "fast", "nan"])
def test_a_bad_pace_variable_is_one_warning_and_the_default_in_zero_code_mode_and_an_error_in_code(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("OTEL_SESSION_PACE_MS", bad)
    settings, warnings = build(dynamo_hosts="d:1", lenient=True)
    assert settings.pace is None and routes_of(settings) == [("dynamo", "d:1")]
    assert warnings == [
        f"otel-session: OTEL_SESSION_PACE_MS: {bad!r} {PACE_WORDS}; new parents are paced 10 to 40 ms "
        f"apart, by the burst{TAIL}"
    ]
    error = raised(dynamo_hosts="d:1")
    assert (
        error.name == "OTEL_SESSION_PACE_MS" and str(error) == f"OTEL_SESSION_PACE_MS: {bad!r} {PACE_WORDS}"
    )


def test_configure_takes_the_pace_and_the_library_paces_by_it() -> None:
    from otel_session import _gathering, _pacing

    try:
        assert otel_session.configure(dynamo_hosts="d:1", pace_ms=40).pace == pytest.approx(0.04)
        assert _gathering._pace() == pytest.approx(0.04)
    finally:
        otel_session.unconfigure()
    assert _gathering._pace() is None  # by the burst (``_pacing.apart``)
    assert _pacing.apart(None, 1) == _pacing.WIDE
