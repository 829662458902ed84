"""requests (and plain urllib3) over loopback: the router's header to routers, baggage to trusted hosts,
nothing to anyone else, on every hop (retries, redirects, proxies), the caller's objects untouched."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import trustme
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

import otel_session
from otel_session import SESSION_HEADER, _evidence
from tests.proxy import RecordingProxy
from tests.recorder import Recorder

OURS = {"x-dynamo-session-id", "x-dynamo-parent-session-id", "baggage", "traceparent"}


def _configure(dynamo: Recorder, gym: Recorder) -> None:
    otel_session.configure(dynamo_hosts=[dynamo.authority], trusted_hosts=[gym.authority])


@pytest.mark.parametrize("how", ["requests.get", "Session", "urllib3.request", "PoolManager"])
def test_router_gets_its_header_trusted_host_baggage_others_nothing(
    how: str, dynamo: Recorder, gym: Recorder, other: Recorder
) -> None:
    _configure(dynamo, gym)
    manager = urllib3.PoolManager()
    with otel_session.trajectory() as traj, requests.Session() as session:
        for server in (dynamo, gym, other):
            url = f"{server.url}/v1/x"
            if how == "requests.get":
                requests.get(url, timeout=10).raise_for_status()
            elif how == "Session":
                session.get(url, timeout=10).raise_for_status()
            elif how == "urllib3.request":
                assert urllib3.request("GET", url, timeout=10).status == 200
            else:
                assert manager.request("GET", url, timeout=10).status == 200
    [at_dynamo], [at_gym], [at_other] = dynamo.requests, gym.requests, other.requests
    assert at_dynamo.get(SESSION_HEADER) == traj.session_id
    assert "baggage" not in at_dynamo.names()
    assert at_gym.get("baggage") == f"session.id={traj.session_id}"
    assert SESSION_HEADER.lower() not in at_gym.names()
    assert not at_other.names() & OURS, at_other.headers


def test_outside_a_trajectory_nothing_and_the_callers_headers_are_untouched(
    dynamo: Recorder, gym: Recorder
) -> None:
    _configure(dynamo, gym)
    requests.get(f"{dynamo.url}/outside", timeout=10).raise_for_status()
    assert not dynamo.requests[0].names() & OURS
    with otel_session.trajectory(), requests.Session() as session:
        prepared = session.prepare_request(requests.Request("GET", f"{dynamo.url}/inside"))
        before = dict(prepared.headers)
        session.send(prepared, timeout=10).raise_for_status()
    assert dict(prepared.headers) == before  # the caller's PreparedRequest holds nothing of ours
    assert dynamo.requests[1].get(SESSION_HEADER)


def test_a_hand_set_header_is_left_as_set(dynamo: Recorder, gym: Recorder) -> None:
    _configure(dynamo, gym)
    with otel_session.trajectory():
        requests.get(f"{dynamo.url}/x", headers={"X-Dynamo-Session-ID": "mine"}, timeout=10)
        urllib3.request("GET", f"{dynamo.url}/y", headers={"x-dynamo-session-id": "mine-too"})
    assert [seen.values(SESSION_HEADER) for seen in dynamo.requests] == [["mine"], ["mine-too"]]


@pytest.mark.parametrize("client", ["requests", "urllib3"])
def test_retries_keep_the_session(client: str, dynamo: Recorder, gym: Recorder) -> None:
    """urllib3's Retry sends again from inside ``urlopen``, with our copy: the same session each time."""
    _configure(dynamo, gym)
    dynamo.fail_next.extend([503, 503])
    retry = Retry(total=3, status_forcelist=[503], backoff_factor=0, allowed_methods=None)
    with otel_session.trajectory() as traj:
        if client == "requests":
            with requests.Session() as session:
                session.mount("http://", HTTPAdapter(max_retries=retry))
                assert session.post(f"{dynamo.url}/v1/chat/completions", json={}, timeout=10).ok
        else:
            answer = urllib3.PoolManager(retries=retry).request("POST", f"{dynamo.url}/v1/chat/completions")
            assert answer.status == 200
    assert [seen.values(SESSION_HEADER) for seen in dynamo.requests] == [[traj.session_id]] * 3


def test_a_routers_error_answer_is_evidence(dynamo: Recorder, gym: Recorder) -> None:
    _configure(dynamo, gym)
    _evidence.forget()
    dynamo.fail_next.append(503)
    with otel_session.trajectory():
        assert requests.get(f"{dynamo.url}/v1/models", timeout=10).status_code == 503
    [summary] = _evidence.summaries().values()
    assert summary["error_answers"] == 1, summary


@pytest.mark.parametrize("client", ["requests", "urllib3"])
def test_a_redirect_to_another_host_carries_nothing(
    client: str, dynamo: Recorder, gym: Recorder, other: Recorder
) -> None:
    _configure(dynamo, gym)
    dynamo.redirect_to = f"{other.url}/landed"
    with otel_session.trajectory() as traj:
        if client == "requests":
            answer = requests.get(f"{dynamo.url}/r/a", timeout=10)
            assert answer.ok and answer.history
        else:
            assert urllib3.PoolManager().request("GET", f"{dynamo.url}/r/a").status == 200
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id
    [landed] = other.requests
    assert not landed.names() & OURS, landed.headers


def test_a_redirect_a_pool_follows_itself_carries_the_session_once(dynamo: Recorder, gym: Recorder) -> None:
    """A pool follows a redirect to its own host by calling ``urlopen`` again with our copy of the
    headers (after a 303, a copy of that): planned again from the caller's, never doubled."""
    _configure(dynamo, gym)
    dynamo.redirect_to = "/landed"
    pool = urllib3.HTTPConnectionPool(dynamo.host, dynamo.port)
    with otel_session.trajectory() as traj:
        assert pool.urlopen("GET", "/r/a", headers={"baggage": "k=v"}).status == 200
    assert [seen.path for seen in dynamo.requests] == ["/r/a", "/landed/a"]
    for seen in dynamo.requests:
        assert seen.values(SESSION_HEADER) == [traj.session_id]
        assert seen.values("baggage") == ["k=v"]  # the caller's own, as set, on both


def test_a_redirect_from_another_host_to_the_router_gets_the_session(
    dynamo: Recorder, gym: Recorder, other: Recorder
) -> None:
    _configure(dynamo, gym)
    other.redirect_to = f"{dynamo.url}/landed"
    with otel_session.trajectory() as traj:
        assert requests.get(f"{other.url}/r/a", timeout=10).ok
    assert not other.requests[0].names() & OURS
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id


def test_streaming(dynamo: Recorder, gym: Recorder) -> None:
    _configure(dynamo, gym)
    with otel_session.trajectory() as traj:
        with requests.get(f"{dynamo.url}/stream", stream=True, timeout=10) as answer:
            body = b"".join(answer.iter_content(chunk_size=3))
        assert b"ok" in body
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1/x",
        "http://exa mple.com/",
        "http://127.0.0.1:0/",
        "http://127.0.0.1:99999/",
        "ftp://127.0.0.1/",
        "127.0.0.1/x",
        "http:///x",
        "http://\u0430.invalid/",
    ],
)
def test_a_bad_url_raises_what_requests_raises(url: str, dynamo: Recorder, gym: Recorder) -> None:
    def error() -> type[BaseException] | None:
        try:
            requests.get(url, timeout=2)
        except Exception as exc:
            return type(exc)
        return None

    bare = error()
    _configure(dynamo, gym)
    with otel_session.trajectory():
        assert error() is bare


# ---- proxies -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_dynamo(ca: trustme.CA, tmp_path: Path) -> Iterator[Recorder]:
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    with Recorder(tls=(str(cert_file), str(key_file))) as server:
        yield server


@pytest.fixture
def proxy() -> Iterator[RecordingProxy]:
    with RecordingProxy() as running:
        yield running


def test_an_https_proxys_connect_carries_nothing_the_tunnelled_request_does(
    tls_dynamo: Recorder, proxy: RecordingProxy, ca: trustme.CA, tmp_path: Path
) -> None:
    otel_session.configure(dynamo_hosts=[tls_dynamo.authority], trusted_hosts=[tls_dynamo.authority])
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    with otel_session.trajectory() as traj:
        answer = requests.get(
            f"{tls_dynamo.url}/v1/models", proxies={"https": proxy.url}, verify=str(bundle), timeout=10
        )
        assert answer.ok
    [connect] = proxy.seen
    assert connect.method == "CONNECT" and not connect.names() & OURS, connect.headers
    [arrived] = tls_dynamo.requests
    assert arrived.get(SESSION_HEADER) == traj.session_id
    assert arrived.get("baggage") == f"session.id={traj.session_id}"


def test_a_forwarded_request_is_planned_for_its_url_not_the_proxy(
    dynamo: Recorder, gym: Recorder, other: Recorder, proxy: RecordingProxy
) -> None:
    """Plain http through a proxy goes to the proxy's pool with the absolute URL: that URL is where
    it goes. The proxy is configured as a router too, to show its own address is not what counts."""
    otel_session.configure(dynamo_hosts=[dynamo.authority, f"127.0.0.1:{proxy.port}"])
    with otel_session.trajectory() as traj:
        for server in (dynamo, other):
            assert requests.get(f"{server.url}/p", proxies={"http": proxy.url}, timeout=10).ok
    assert [seen.method for seen in proxy.seen] == ["GET", "GET"]
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id
    assert not other.requests[0].names() & OURS, other.requests[0].headers


# ---- destinations, as the attack batteries check them -----------------------------------------


class _Canned(urllib3.connection.HTTPSConnection):
    """A connection that records the host and port urllib3 would dial and the request head it
    writes, and answers 200 itself: a fake of the network, so hostile host names need no DNS."""

    dialed: list[tuple[str, int]] = []  # noqa: RUF012
    heads: list[bytes] = []  # noqa: RUF012

    def connect(self) -> None:
        """Never dials (an https pool asks for a connection before its first request)."""

    def request(self, method: str, url: str, body: Any = None, headers: Any = None, **kw: Any) -> None:
        type(self).dialed.append((self.host, self.port))
        lines = [f"{method} {url} HTTP/1.1", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        type(self).heads.append("\r\n".join(lines).encode("latin-1"))

    def getresponse(self) -> Any:  # type: ignore[override]
        return urllib3.response.HTTPResponse(body=b"", status=200, headers={}, preload_content=False)


def test_destinations_through_the_urllib3_hook() -> None:
    from hypothesis import assume, given

    from tests.generated import MANY
    from tests.test_hostile import DYNAMO_PATTERNS, TRUSTED_PATTERNS, check_delivery, urls

    otel_session.configure(dynamo_hosts=DYNAMO_PATTERNS, trusted_hosts=TRUSTED_PATTERNS)

    class Pool(urllib3.HTTPConnectionPool):
        ConnectionCls = _Canned

    class TlsPool(urllib3.HTTPSConnectionPool):
        ConnectionCls = _Canned

    manager = urllib3.PoolManager(retries=False)
    manager.pool_classes_by_scheme = {"http": Pool, "https": TlsPool}

    def send(url: str) -> type[BaseException] | None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                manager.request("GET", url)
        except Exception as exc:
            return type(exc)
        return None

    @MANY
    @given(urls())
    def check(url: str) -> None:
        _Canned.dialed.clear()
        _Canned.heads.clear()
        manager.clear()
        with otel_session.trajectory() as traj:
            error = send(url)
        if error is not None:
            otel_session.unconfigure()
            try:
                assert send(url) is error
            finally:
                otel_session.configure(dynamo_hosts=DYNAMO_PATTERNS, trusted_hosts=TRUSTED_PATTERNS)
            assume(False)
        assert traj.session_id is not None and len(_Canned.heads) == 1
        host, port = _Canned.dialed[0]
        scheme = url.partition(":")[0].lower()
        lines = _Canned.heads[0].decode("latin-1").split("\r\n")[1:]
        sent = [(name.strip(), value.strip()) for name, _, value in (line.partition(":") for line in lines)]
        ours = [(name, value) for name, value in sent if name.lower() in OURS]
        check_delivery(ours, host, port, scheme, traj.session_id)

    check()


def test_a_redirect_a_forwarding_pool_follows_to_another_host_carries_nothing(
    dynamo: Recorder, gym: Recorder, other: Recorder, proxy: RecordingProxy
) -> None:
    """A proxy's pool forwards any absolute URL, so a redirect it follows itself may go to another
    host, in a ``urlopen`` called with our copy of the headers: started again from the caller's."""
    _configure(dynamo, gym)
    dynamo.redirect_to = f"{other.url}/landed"
    pool = urllib3.ProxyManager(proxy.url).connection_from_url(dynamo.url)
    with otel_session.trajectory() as traj:
        answer = pool.urlopen("GET", f"{dynamo.url}/r/a", assert_same_host=False, headers={"X-Mine": "1"})
        assert answer.status == 200
    assert dynamo.requests[0].get(SESSION_HEADER) == traj.session_id
    [landed] = other.requests
    assert not landed.names() & OURS, landed.headers
    assert landed.get("X-Mine") == "1"
