"""Two Dynamo frontends over the same workers behind a real nginx (Debian's package, on loopback).

Dynamo 1.3.0.post1's frontends do not share session bindings: a balancer that spreads one session's
turns over both frontends splits it, unless it hashes ``X-Dynamo-Session-ID`` consistently, the
recipe docs/integrations.md gives (benchmarks/frontends.py, whose config this runs). The frontends
route at random over 8 workers, so a split session lands on one worker only by chance.
Dynamo 1.6.1 shares bindings between replicas: there round-robin in front keeps sessions pinned.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.frontends import measure, two_frontends
from benchmarks.harness import HASH_DIRECTIVE, NGINX_CONF, Nginx, nginx_binary
from otel_session.dynamo.workload import Workload
from tests.dynamo_fixtures import dynamo_python_for

WORKLOAD = Workload(prompts=12, siblings=1, turns=4, prompt_words=200, turn_words=30)


@pytest.fixture(scope="module")
def nginx_ok() -> None:
    if nginx_binary() is None:
        if os.environ.get("OTEL_SESSION_REQUIRE_DYNAMO") == "1":
            pytest.fail("nginx is not installed; scripts/test installs it (apt-get install nginx-light)")
        pytest.skip("nginx is not installed")


@pytest.mark.slow
def test_nginx_hashing_the_session_header_pins_sessions_over_two_1_3_frontends(nginx_ok: None) -> None:
    python = dynamo_python_for("1.3.0.post1")
    with two_frontends(python, "random", replica_sync=False, workers=8) as stack:
        hashed = measure(stack, hash_session=True, sessions=True, workload=WORKLOAD, concurrency=3)
        spread = measure(stack, hash_session=False, sessions=True, workload=WORKLOAD, concurrency=3)
    assert hashed.errors == spread.errors == 0
    assert hashed.pinned == hashed.trajectories == 12
    # Without the hash each frontend binds the session on its own, at random among 8 workers. A
    # trajectory stays together by chance when all 4 turns reach one frontend (about 1 in 8) or both
    # frontends pick the same worker (1 in 8): p ~ 0.23, so 9 or more of 12 pinned has P ~ 2e-4.
    assert spread.pinned <= 8, spread


@pytest.mark.slow
def test_1_6_frontends_share_bindings_so_round_robin_in_front_keeps_sessions(nginx_ok: None) -> None:
    with two_frontends(None, "random", replica_sync=False, workers=8) as stack:
        spread = measure(stack, hash_session=False, sessions=True, workload=WORKLOAD, concurrency=3)
        control = measure(stack, hash_session=False, sessions=False, workload=WORKLOAD, concurrency=3)
    assert spread.errors == control.errors == 0
    assert spread.pinned == 12
    # No session: random routing over 8 workers keeps a trajectory's 4 turns together 1 in 512.
    assert control.pinned <= 2, control


@pytest.mark.slow
def test_nginx_is_stopped_by_pid_and_leaves_nothing(nginx_ok: None) -> None:
    nginx = Nginx(["127.0.0.1:9"], hash_session=True).start()
    assert nginx.proc is not None and nginx.dir is not None
    pid, conf = nginx.proc.pid, nginx.dir / "nginx.conf"
    assert "hash $http_x_dynamo_session_id consistent;" in conf.read_text()
    nginx.stop()
    assert not conf.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_documented_recipe_is_the_one_the_test_runs() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text(encoding="utf-8")
    assert HASH_DIRECTIVE in text and "{hash}" in NGINX_CONF
    for line in ("proxy_http_version 1.1;", 'proxy_set_header Connection "";', "proxy_buffering off;"):
        assert line in text and line in NGINX_CONF
