"""What the tools let through of the library's own log: in process, against the real library.

The demo and ``doctor`` filter the ``otel_session`` logger only for as long as they need to, and only
what they mean to: the "sent outside any trajectory" line for their own deliberate requests (this
thread's, inside the block), and a warning already shown once in the same run.
"""

from __future__ import annotations

import logging
import threading

import httpx
import pytest

import otel_session
from otel_session import _hop
from otel_session.dynamo._library_log import each_warning_once, no_session_on_purpose
from tests.recorder import Recorder

OUTSIDE = "outside any trajectory"


def _told(caplog: pytest.LogCaptureFixture, words: str) -> int:
    return sum(words in record.getMessage() for record in caplog.records)


def _outside_request(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One request to the router host outside any trajectory, with the library's once-per-process
    line not yet used up, so it is logged unless something filters it."""
    monkeypatch.setattr(_hop, "untold", True)
    httpx.get(url + "/v1/models")


def test_only_this_threads_deliberate_requests_go_untold_and_only_inside_the_block(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, "otel_session")
    otel_session.configure(dynamo_hosts=[dynamo.url])
    with no_session_on_purpose():
        _outside_request(dynamo.url, monkeypatch)
        assert _told(caplog, OUTSIDE) == 0
        elsewhere = threading.Thread(target=_outside_request, args=(dynamo.url, monkeypatch))
        elsewhere.start()
        elsewhere.join()
        assert _told(caplog, OUTSIDE) == 1  # another thread's request is not ours to hide
        monkeypatch.setenv("OTEL_SESSION_ADOPT", "bad")
        otel_session.configure(dynamo_hosts=[dynamo.url])
        assert _told(caplog, "OTEL_SESSION_ADOPT='bad'") == 1  # any other warning still shows
    _outside_request(dynamo.url, monkeypatch)
    assert _told(caplog, OUTSIDE) == 2  # after the block, the library tells again
    assert [r.get("x-dynamo-session-id") for r in dynamo.requests] == [None, None, None]


def test_a_warning_shows_once_inside_the_block_and_again_after_it(
    dynamo: Recorder, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, "otel_session")
    monkeypatch.setenv("OTEL_SESSION_ADOPT", "bad")
    with each_warning_once():
        otel_session.configure(dynamo_hosts=[dynamo.url])
        otel_session.configure(dynamo_hosts=[dynamo.url])
        assert _told(caplog, "OTEL_SESSION_ADOPT='bad'") == 1
        monkeypatch.setenv("OTEL_SESSION_ADOPT", "worse")
        otel_session.configure(dynamo_hosts=[dynamo.url])
        assert _told(caplog, "OTEL_SESSION_ADOPT='worse'") == 1  # a different warning is new
    otel_session.unconfigure()  # the library itself says a warning once until then
    otel_session.configure(dynamo_hosts=[dynamo.url])
    assert _told(caplog, "OTEL_SESSION_ADOPT='worse'") == 2
