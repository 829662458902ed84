"""configure(): arguments, environment, errors that name their cause, repeat calls and undo."""

from __future__ import annotations

import httpx
import pytest
import wrapt
from opentelemetry import propagate

import otel_session
from otel_session import SESSION_HEADER
from otel_session._propagator import SessionPropagator
from otel_session._settings import SettingError
from tests.recorder import Recorder


def test_environment_is_read_when_arguments_are_missing(
    monkeypatch: pytest.MonkeyPatch, dynamo: Recorder
) -> None:
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", f" , {dynamo.authority} ,, other:1 ")
    monkeypatch.setenv("OTEL_SESSION_TRUSTED_HOSTS", "gym-agent:9000")
    settings = otel_session.configure()
    assert [p.host for _, p in settings.rules.routes] == ["127.0.0.1", "other"]
    assert [(p.host, p.port) for p in settings.rules.trusted] == [("gym-agent", 9000)]
    assert settings.tracing is False
    with otel_session.trajectory() as traj:
        httpx.get(dynamo.url)
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id


@pytest.mark.parametrize("value", ["true", "1", "YES", "On", "false", "0", "no", "OFF", ""])
def test_tracing_variable_accepts_the_usual_spellings(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from otel_session._settings import parse_bool_env

    monkeypatch.setenv("OTEL_SESSION_TRACING", value)
    assert parse_bool_env("OTEL_SESSION_TRACING") is (value.lower() in {"true", "1", "yes", "on"})


def test_a_bad_tracing_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_TRACING", "maybe")
    with pytest.raises(ValueError, match="OTEL_SESSION_TRACING"):
        otel_session.configure(dynamo_hosts=["d"])


@pytest.mark.parametrize("argument", ["tracing", "end_sessions", "servers"])
@pytest.mark.parametrize("word", ["false", "off", "0", "No"])
def test_a_switch_passed_as_a_word_means_what_it_says(argument: str, word: str, dynamo: Recorder) -> None:
    """An application passing on a config file's "false" must not switch the feature on (``bool()``
    of any non-empty string is True: tracing started and every Dynamo request got a traceparent)."""
    settings = otel_session.configure(dynamo_hosts=[dynamo.authority], **{argument: word})
    assert settings.tracing is settings.end_sessions is False
    with otel_session.trajectory() as traj:
        assert not traj.span.get_span_context().is_valid
        httpx.get(dynamo.url)
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id
    assert dynamo.requests[-1].get("traceparent") is None
    assert otel_session.configure(dynamo_hosts=[dynamo.authority], end_sessions="on").end_sessions is True


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("tracing", "maybe"),
        ("tracing", 2),
        ("end_sessions", [True]),
        ("servers", 0.0),
        ("servers", "enabled"),
        ("end_sessions", " "),  # blank: unset in a variable, but nothing said here
    ],
)
def test_a_switch_that_is_not_a_boolean_names_itself_and_changes_nothing(
    argument: str, value: object, dynamo: Recorder
) -> None:
    """A bad switch of any type is one ``ValueError`` (a ``SettingError``) naming it."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with pytest.raises(SettingError, match=argument) as raised:
        otel_session.configure(dynamo_hosts=["elsewhere:1"], **{argument: value})
    assert isinstance(raised.value, ValueError) and raised.value.name == argument
    assert "\n" not in str(raised.value)
    with otel_session.trajectory() as traj:
        httpx.get(dynamo.url)
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id


def test_a_malformed_pattern_names_itself_and_changes_nothing(dynamo: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with pytest.raises(ValueError, match=r"'dynamo:http'"):
        otel_session.configure(dynamo_hosts=["dynamo:http"])
    with otel_session.trajectory() as traj:
        httpx.get(dynamo.url)
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id


def test_a_malformed_environment_pattern_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "ok-host,bad host")
    with pytest.raises(ValueError, match=r"OTEL_SESSION_DYNAMO_HOSTS.*'bad host'"):
        otel_session.configure()


def test_second_configure_replaces_the_first(dynamo: Recorder, other: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    otel_session.configure(dynamo_hosts=[other.authority])
    with otel_session.trajectory() as traj:
        httpx.get(dynamo.url)
        httpx.get(other.url)
    assert dynamo.requests[-1].get(SESSION_HEADER) is None
    assert other.requests[-1].get(SESSION_HEADER) == traj.session_id


def test_unconfigure_restores_the_propagator_and_sends_nothing(dynamo: Recorder) -> None:
    before = propagate.get_global_textmap()
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    assert isinstance(propagate.get_global_textmap(), SessionPropagator)
    otel_session.unconfigure()
    assert propagate.get_global_textmap() is before
    with otel_session.trajectory():
        httpx.get(dynamo.url)
    assert dynamo.requests[-1].get(SESSION_HEADER) is None
    assert not isinstance(httpx.HTTPTransport.__dict__["handle_request"], wrapt.FunctionWrapper)


def test_clients_created_before_configure_are_covered(dynamo: Recorder) -> None:
    client = httpx.Client()
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with otel_session.trajectory() as traj:
        client.get(dynamo.url)
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id


def test_public_names() -> None:
    assert otel_session.SESSION_HEADER == "X-Dynamo-Session-ID"
    assert otel_session.PARENT_SESSION_HEADER == "X-Dynamo-Parent-Session-ID"


def test_the_callers_request_object_is_left_unchanged(dynamo: Recorder) -> None:
    """Headers are added for the hop only, so a Request reused elsewhere carries nothing of ours."""
    otel_session.configure(dynamo_hosts=[dynamo.authority])
    with httpx.Client() as client, otel_session.trajectory() as traj:
        request = client.build_request("GET", dynamo.url)
        response = client.send(request)
    assert dynamo.requests[-1].get(SESSION_HEADER) == traj.session_id
    assert SESSION_HEADER not in request.headers
    assert SESSION_HEADER not in response.request.headers


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("127.0.0.0/8", "network range"),
        ("10.0.0.0/24", "network range"),
        ("http//127.0.0.1:18101", "needs '://'"),
        ("http:/127.0.0.1:18101", "needs '://'"),
        ("https:dynamo", "needs '://'"),
        ("http.//dynamo:8000", "needs '://'"),
        ("10/8", "network range"),
        ("192.168/16", "network range"),
        ("10.0.0.0/255.0.0.0", "network range"),
        ("10.0.0.0/8:8000", "network range"),
        ("10", "not a valid host name or IP address"),
        ("192.168", "not a valid host name or IP address"),
    ],
)
def test_a_pattern_that_would_be_read_as_another_host_is_refused(bad: str, says: str) -> None:
    with pytest.raises(SettingError, match=f"dynamo_hosts: host pattern {bad!r}: .*{says}"):
        otel_session.configure(dynamo_hosts=[bad])


def test_configure_errors_name_the_argument() -> None:
    with pytest.raises(SettingError, match=r"^dynamo_hosts: host pattern must be a str, not int"):
        otel_session.configure(dynamo_hosts=[18101])  # type: ignore[list-item]
    with pytest.raises(SettingError, match=r"^trusted_hosts: host pattern 'bad host'"):
        otel_session.configure(trusted_hosts=["bad host"])
    with pytest.raises(SettingError, match=r"^routers\['vllm-router'\]: host pattern 'bad host'"):
        otel_session.configure(routers={"vllm-router": ["ok:1", "bad host"]})


def test_the_settings_show_each_pattern_as_it_was_read() -> None:
    settings = otel_session.configure(
        dynamo_hosts=["127.0.0.1:18080/v1", "https://Dyn.Internal/v1", "[::1]:8000"],
        trusted_hosts=["*.gym.corp"],
        routers={"vllm-router": "vr:30000"},
    )
    shown = repr(settings)
    for text in (
        "127.0.0.1:18080",
        "https://dyn.internal:443",
        "[::1]:8000",
        "*.gym.corp",
        "vllm-router=[vr:30000]",
    ):
        assert text in shown
    assert "object at 0x" not in shown


def test_an_environment_router_entry_keeps_its_good_patterns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from otel_session import _settings

    monkeypatch.setenv("OTEL_SESSION_ROUTERS", "vllm-router=127.0.0.1:18102,smg=127.0.0.1:9")
    settings, warnings = _settings.build(lenient=True)
    assert settings.rules.route("http", "127.0.0.1", 18102).profile is not None
    assert settings.rules.route("http", "127.0.0.1", 9).profile is None
    [warning] = warnings
    assert "'smg=127.0.0.1:9'" in warning and "separate routers with ';'" in warning


def test_add_dynamo_hosts_hands_children_every_dynamo_host_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "")  # restored after the test, whatever it writes
    otel_session.configure(dynamo_hosts=["127.0.0.1:18101", "https://dyn:8443"], trusted_hosts=["gym:1"])
    entries = otel_session.add_dynamo_hosts("127.0.0.1:18102")
    assert sorted(entries) == ["127.0.0.1:18101", "127.0.0.1:18102", "https://dyn:8443"]
    assert otel_session.add_dynamo_hosts("127.0.0.1:18102", "127.0.0.1:18101") == entries  # no repeats
    import os

    from otel_session import _settings

    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", os.environ["OTEL_SESSION_DYNAMO_HOSTS"])
    child, _ = _settings.build(lenient=True)  # what a child process reads
    for port in (18101, 18102):
        assert child.rules.route("http", "127.0.0.1", port).profile is not None
    assert child.rules.route("https", "dyn", 8443).profile is not None


def test_zero_code_with_every_host_refused_says_so_not_that_none_was_set(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from otel_session import _environment

    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "bad host")
    with caplog.at_level("WARNING", logger="otel_session"):
        _environment.configure_from_environment()
    lines = [record.getMessage() for record in caplog.records]
    assert any("'bad host'" in line for line in lines)
    assert any("no router or trusted host is left" in line for line in lines)
    assert not any("pass dynamo_hosts" in line for line in lines)


def test_configuring_again_from_the_same_variables_says_each_warning_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_SESSION_ADOPT", "junk")
    with caplog.at_level("WARNING", logger="otel_session"):
        otel_session.configure(dynamo_hosts=["a:1"])
        otel_session.configure(dynamo_hosts=["a:2"])
        assert sum("OTEL_SESSION_ADOPT" in r.getMessage() for r in caplog.records) == 1
        otel_session.unconfigure()
        otel_session.configure(dynamo_hosts=["a:1"])
    assert sum("OTEL_SESSION_ADOPT" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize(
    ("spelling", "means"),
    [
        ("[::1]:18080/v1", "[::1]:18080"),
        ("[::1]/v1", "[::1]"),
        ("localhost/v1", "localhost"),
        ("https-gw:443", "https-gw:443"),
    ],
)
def test_a_base_url_copied_without_its_scheme_still_reads_as_its_host(spelling: str, means: str) -> None:
    assert f"dynamo=[{means}]" in repr(otel_session.configure(dynamo_hosts=[spelling]).rules)


def test_a_malformed_routers_entry_leaves_the_others_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_session import _settings

    monkeypatch.setenv("OTEL_SESSION_ROUTERS", "vllm-router=vr:1;smg=gw:2;garbage;litellm=")
    settings, warnings = _settings.build(lenient=True)
    assert "vllm-router=[vr:1]" in repr(settings.rules) and "smg=[gw:2]" in repr(settings.rules)
    assert len(warnings) == 2 and all("is not PROFILE=PATTERN" in w for w in warnings)
    with pytest.raises(SettingError, match="'garbage' is not PROFILE=PATTERN"):
        otel_session.configure()  # in code, the variable's first malformed entry is an error


def test_one_pattern_given_to_two_routers_is_refused_or_kept_by_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from otel_session import _settings

    with pytest.raises(SettingError, match="given to both dynamo and smg"):
        otel_session.configure(dynamo_hosts=["gw:1"], routers={"smg": ["gw:1"]})
    monkeypatch.setenv("OTEL_SESSION_DYNAMO_HOSTS", "gw:1")
    monkeypatch.setenv("OTEL_SESSION_ROUTERS", "smg=gw:1,other:2")
    settings, [warning] = _settings.build(lenient=True)
    assert "dynamo keeps it" in warning
    assert repr(settings.rules) == "HostRules(routers: dynamo=[gw:1], smg=[other:2]; trusted: [])"
