"""The API key: every protected route refuses a missing or wrong key with OpenAI's 401, the open
routes stay open, the comparison is timing-safe, and `serve` takes the key from the flag or the
environment. The app here is the real one; its model is a broken file, so the engine never loads
(what the key guards is the HTTP layer, which answers before any engine work)."""

from __future__ import annotations

import argparse
import hmac

import pytest
from starlette.testclient import TestClient

from adaspark.errors import UserError
from adaspark.server import create_app
from adaspark.server.auth import ApiKey, is_open

KEY = "sk-test-0123456789"
PROTECTED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/adaspark/state"),
    ("GET", "/v1/nothing"),  # unknown paths too: nothing is open by accident
    ("GET", "/metrics"),
    ("GET", "/dashboard/data"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
]
METRICS = {"/metrics", "/dashboard/data"}
OPEN = [("GET", "/health"), ("GET", "/dashboard"), ("GET", "/dashboard/static/dashboard.js"),
        ("GET", "/dashboard/static/dashboard.css")]


def app_with(tmp_path, **kw):
    from adaspark.engine import Engine

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a model")
    return create_app(lambda: Engine.load(broken), model_id="broken", **kw)


def call(client, method, path, key=None, scheme="Bearer"):
    headers = {} if key is None else {"Authorization": f"{scheme} {key}"}
    body = {"messages": [{"role": "user", "content": "hi"}]} if method == "POST" else None
    return client.request(method, path, headers=headers, json=body)


def assert_refused(response):
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert KEY not in response.text


@pytest.fixture
def keyed(tmp_path):
    with TestClient(app_with(tmp_path, api_key=KEY)) as client:
        yield client


@pytest.mark.parametrize("method, path", PROTECTED)
def test_every_protected_route_needs_the_key(keyed, method, path):
    assert_refused(call(keyed, method, path))
    assert_refused(call(keyed, method, path, key="wrong"))
    assert_refused(call(keyed, method, path, key=KEY + "x"))
    assert_refused(call(keyed, method, path, key=KEY[:-1]))
    assert_refused(call(keyed, method, path, key=KEY, scheme="Basic"))
    assert call(keyed, method, path, key=KEY).status_code != 401
    assert call(keyed, method, path, key=KEY, scheme="bearer").status_code != 401


@pytest.mark.parametrize("method, path", OPEN)
def test_health_and_the_dashboard_page_stay_open(keyed, method, path):
    assert call(keyed, method, path).status_code != 401


def test_the_dashboard_page_holds_no_data_and_loads_only_from_the_server(keyed):
    page = call(keyed, "GET", "/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "connect-src 'self'" in csp
    assert "http" not in page.text.replace("http-equiv", "")  # no outside address at all
    assert call(keyed, "GET", "/dashboard/static/other.js").status_code == 404


def test_public_metrics_opens_metrics_and_dashboard_data_only(tmp_path):
    with TestClient(app_with(tmp_path, api_key=KEY, public_metrics=True)) as client:
        for method, path in PROTECTED:
            response = call(client, method, path)
            if path in METRICS:
                assert response.status_code == 200
            else:
                assert_refused(response)
        assert "adaspark_requests_waiting" in call(client, "GET", "/metrics").text


def test_without_a_key_everything_is_open(tmp_path):
    with TestClient(app_with(tmp_path)) as client:
        for method, path in PROTECTED + OPEN:
            assert call(client, method, path).status_code != 401
        # no engine, so no scheduler: the state says so rather than failing
        state = call(client, "GET", "/v1/adaspark/state").json()
        assert state["ready"] is False and state["scheduler"] is None
        assert state["served"]["requests"] == 0 and state["history"] == []


def test_the_comparison_is_timing_safe(keyed, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("adaspark.server.auth.hmac.compare_digest", spy)
    assert_refused(call(keyed, "GET", "/v1/models", key="short"))
    assert call(keyed, "GET", "/v1/models", key=KEY).status_code == 200
    assert_refused(call(keyed, "GET", "/v1/models"))
    assert len(calls) == 3
    # both sides are digests of one length, so the comparison's time says nothing of the key
    assert all(len(a) == len(b) == 32 for a, b in calls)


def test_api_key_parsing():
    key = ApiKey(KEY)
    assert key.accepts(f"Bearer {KEY}") and key.accepts(f"BEARER {KEY}")
    for bad in (None, "", KEY, f"Bearer {KEY[:-1]}", f"Token {KEY}", "Bearer ", f"Bearer{KEY}"):
        assert not key.accepts(bad), bad
    for refused in ("", " padded", "padded "):
        with pytest.raises(UserError, match="API key"):
            ApiKey(refused)
    assert is_open("/health", False) and is_open("/dashboard", False)
    assert not is_open("/metrics", False) and is_open("/metrics", True)
    assert not is_open("/v1/adaspark/state", True) and not is_open("/healthz", True)


def test_serve_takes_the_key_from_the_flag_or_the_environment(capsys, tmp_path):
    from adaspark.cli import main
    from adaspark.commands.serve import api_key, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    assert parser.parse_args([]).host == "127.0.0.1"  # loopback unless --host says otherwise
    assert api_key(parser.parse_args([]), {}) is None
    assert api_key(parser.parse_args([]), {"ADASPARK_API_KEY": "from-env"}) == "from-env"
    flagged = parser.parse_args(["--api-key", "from-flag", "--public-metrics"])
    assert api_key(flagged, {"ADASPARK_API_KEY": "from-env"}) == "from-flag"
    assert flagged.public_metrics
    assert main(["serve", "--api-key", "", "--port", "1"]) == 2  # refused before listening
    assert "API key" in capsys.readouterr().err


def test_serve_warns_only_off_loopback():
    from adaspark.commands.serve import _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("::") and not _loopback("192.168.1.5")
