"""``otel-session doctor --watch URL``: is affinity holding in a running deployment, from its own figures.

No probe traffic: every ``--interval`` seconds one GET of a Prometheus text endpoint the deployment
already serves, and one line on what changed since the last. Two families are read, whichever the
endpoint has: otel-session's own metrics as the application exports them (``otel_session_*``, per
router; the turn-level figures ``_verdicts`` judges, so the line says healthy or broken with the same
thresholds as the in-process warning), and the Dynamo frontend's ``/metrics`` (cached and input
tokens over every request, first turns included, and requests refused as overloaded, as a full
session table answers). What each means, and what healthy and broken look like: docs/tracing.md.
"""

from __future__ import annotations

import math
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TextIO

from otel_session import _bounded_http, _verdicts
from otel_session.dynamo.sizing import FULL_ANSWER, FULL_STATUS

Sample = dict[tuple[str, frozenset[tuple[str, str]]], float]
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> Sample:
    """A Prometheus text exposition's samples: (name, labels) -> value; what does not parse is skipped."""
    found: Sample = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None or line.startswith("#"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = frozenset(_LABEL.findall(match.group(2) or ""))
        found[(match.group(1), labels)] = value
    return found


def _increase(old: Sample, new: Sample, names: Iterable[str], **labels: str) -> float:
    """How much every counter series named one of ``names`` holding ``labels`` grew, series by series
    as Prometheus's ``increase`` counts it: a series that went down was restarted (a trainer process
    behind a Collector), so its new value is its growth, and one new since ``old`` grew by all of it.
    Summed before the difference, a restart would subtract the old process's totals from the others'."""
    wanted = set(labels.items())
    chosen = set(names)
    grown = 0.0
    for (name, have), value in new.items():
        if name in chosen and wanted <= have and math.isfinite(value):
            before = old.get((name, have), 0.0)
            grown += value - before if math.isfinite(before) and value >= before else value
    return grown


def _names(base: str) -> tuple[str, str]:
    return base, f"{base}_total"  # an OpenTelemetry counter, with and without Prometheus's suffix


@dataclass
class Window:
    """What changed between two samples, in the figures a person reads."""

    later_turns: float = 0
    later_prompt: float = 0
    later_cached: float = 0
    worker_checks: float = 0
    switches: float = 0
    refused: float = 0
    frontend_input: float = 0
    frontend_cached: float = 0
    frontend_refused: float = 0

    @classmethod
    def between(cls, old: Sample, new: Sample) -> Window:
        def delta(names: Iterable[str], **labels: str) -> float:
            return _increase(old, new, names, **labels)

        return cls(
            later_turns=delta(_names("otel_session_turns"), otel_session_turn="later"),
            later_prompt=delta(_names("otel_session_prompt_tokens"), otel_session_turn="later"),
            later_cached=delta(_names("otel_session_cached_tokens"), otel_session_turn="later"),
            worker_checks=delta(_names("otel_session_worker_checks")),
            switches=delta(_names("otel_session_worker_checks"), otel_session_worker_switched="true"),
            refused=delta(_names("otel_session_error_responses"), http_response_status_code=str(FULL_STATUS)),
            frontend_input=delta(["dynamo_frontend_input_sequence_tokens_sum"]),
            frontend_cached=delta(["dynamo_frontend_cached_tokens_sum"]),
            frontend_refused=delta(["dynamo_frontend_requests_total"], error_type="overload"),
        )

    def verdict(self) -> str:
        """healthy / broken / too little seen, for otel-session's own figures (the same thresholds as
        the warning the application logs); Dynamo's aggregate figures are reported, not judged."""
        if self.refused or self.frontend_refused:
            return f'BROKEN: the session table is full ({FULL_ANSWER}); see docs/integrations.md, "Capacity"'
        if (
            self.worker_checks >= _verdicts.MIN_PAIRS
            and self.switches >= _verdicts.SWITCH_ALARM * self.worker_checks
        ):
            return "BROKEN: turns of one session move between workers; affinity is not holding"
        if self.later_turns >= _verdicts.MIN_JUDGED and self.later_prompt:
            if self.later_cached < _verdicts.MISS_ALARM * self.later_prompt:
                return "BROKEN: later turns find little of their history cached; affinity is not holding"
            return "healthy"
        if self.frontend_input and not self.later_turns:
            return "(Dynamo's own figures only: no otel-session metrics at this endpoint)"
        return "too little traffic to judge"

    def line(self) -> str:
        parts = []
        if self.later_turns:
            share = self.later_cached / self.later_prompt if self.later_prompt else 0.0
            parts.append(f"later turns {self.later_turns:.0f}, {share:.0%} of their prompt cached")
        if self.worker_checks:
            parts.append(f"worker switches {self.switches:.0f} of {self.worker_checks:.0f}")
        if self.frontend_input:
            share = self.frontend_cached / self.frontend_input
            parts.append(f"frontend: {self.frontend_input:.0f} prompt tokens, {share:.0%} cached (all turns)")
        parts.append(f"refused as overloaded {self.refused + self.frontend_refused:.0f}")
        return "; ".join(parts) + f" -> {self.verdict()}"


# A Prometheus page is a few MiB at most (a Dynamo frontend's, some hundred KiB); a body past this is
# not one, and read whole it would take the memory of whatever it streams for the whole timeout.
MAX_BYTES = 64 * 2**20


def shown(url: str) -> str:
    """``url`` as printed: a ``user:password@`` in it is replaced, so a credential never reaches a log."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url if "@" not in url else "<a URL with credentials>"
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def fetch(url: str, timeout: float = 10.0) -> Sample:
    """One GET of the metrics endpoint (the only request ``--watch`` makes), bounded in total by
    ``timeout``: look-up, connect, TLS and every read (a peer trickling its headers a byte at a time
    meets it too), and to ``MAX_BYTES``; no proxy, no redirect followed."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):  # not a file, not ftp
        raise ValueError("a metrics endpoint is an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("a metrics endpoint URL names a host")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    peer = _bounded_http.Peer(scheme, parts.hostname, parts.port, time.monotonic() + timeout)
    body = peer.request("GET", path, None, {"Accept": "text/plain"}, MAX_BYTES + 1)
    if len(body) > MAX_BYTES:
        raise ValueError(f"an answer over {MAX_BYTES // 2**20} MiB is no metrics page")
    text = body.decode("utf-8", "replace")
    found = parse(text)
    if not found:  # a page, but no sample on it: the wrong path (a base URL, /v1/models), else empty
        first = next((line for line in text.splitlines() if line.strip() and not line.startswith("#")), None)
        if first is not None:
            raise ValueError(f"the answer is no Prometheus text: it begins {first.strip()[:60]!r}")
    return found


def watch(
    url: str,
    out: TextIO,
    *,
    interval: float = 10.0,
    samples: int | None = None,
    read: Callable[[str], Sample] = fetch,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Window]:
    """Print one line per ``interval`` on what the endpoint's figures did since the last sample, for
    ``samples`` windows (``None``: until interrupted). Returns the windows seen."""
    out.write(f"otel-session doctor --watch {shown(url)}: one GET every {interval:g} s, no other request\n")
    out.flush()
    seen: list[Window] = []
    old = read(url)
    while samples is None or len(seen) < samples:
        sleep(interval)
        new = read(url)
        window = Window.between(old, new)
        seen.append(window)
        out.write(f"[{len(seen) * interval:>6.0f} s] {window.line()}\n")
        out.flush()
        old = new
    return seen
