"""Bad input over real HTTP: always a 4xx in OpenAI's error shape, never a 500; a bug's 500 says
nothing of the exception; the OpenAPI document declares the error answers.

One uvicorn server runs in a thread for the module, with an API key and a 1 MiB body cap. Its
model never loads (the loader waits on a gate until teardown, then fails): everything tested here
is answered before a request needs the engine.
"""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time

import httpx
import pytest
from test_server import _serving

from adaspark.server import create_app
from adaspark.server.toolcalls import parse_tool_calls

KEY = "test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
CAP = 1 << 20
DEEP = 200_000  # far past any JSON parser's nesting limit and Python's recursion limit
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def port():
    gate = threading.Event()

    def load():
        gate.wait(300)
        raise RuntimeError("this test's model never loads")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("adaspark.server.app.MAX_BODY_BYTES", CAP)
        app = create_app(load, model_id="m", api_key=KEY)
    with _serving(app) as base:
        yield int(base.rsplit(":", 1)[1])
        gate.set()  # lets the engine thread end


def _post(port: int, body: str | bytes) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body,
                      headers={**AUTH, "content-type": "application/json"}, timeout=60)


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_deeply_nested_tool_call_arguments_get_400(port):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * DEEP}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    response = _post(port, json.dumps({"messages": messages}))
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages.1.tool_calls"
    assert "Recursion" not in response.text and "Traceback" not in response.text


@pytest.mark.parametrize("template", [
    '{{"messages": {deep}}}',
    '{{"messages": [{{"role": "user", "content": {deep}}}]}}',
    '{{"messages": [{{"role": "user", "content": "hi"}}], "tools": [{{"type": "function", '
    '"function": {{"name": "f", "parameters": {{"x": {deep}}}}}}}]}}',
    '{{"messages": [{{"role": "user", "content": "hi"}}], "response_format": {{"x": {deep}}}}}',
    '{{"messages": [{{"role": "user", "content": "hi"}}], "tool_choice": {{"x": {deep}}}}}',
    '{{"messages": [{{"role": "user", "content": "hi"}}], "stop": {deep}}}',
    "{deep}",
])
def test_deeply_nested_request_bodies_get_400(port, template):
    response = _post(port, template.format(deep=_nested(DEEP)))
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert "recursion limit" in error["message"]  # says why, not just "invalid"


def test_a_deeply_nested_tool_call_in_a_reply_stays_text():
    # the model's own text: json.loads raised RecursionError here, a 500 after the reply
    assert parse_tool_calls("<tool_call>" + "[" * DEEP + "</tool_call>") is None
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "' + "[" * DEEP + '"}') is None


def _chunked_post(port: int, body: bytes, piece: int = 64 << 10) -> bytes:
    """POST `body` chunked, `piece` bytes a chunk; stops sending once the server answers."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(head)
        for start in range(0, len(body), piece):
            chunk = body[start:start + piece]
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            # answered already: stop sending (past the cap, wait for it: more bytes sent to a
            # server that has closed would reset the connection before its answer is read)
            if select.select([conn], [], [], 2 if start + piece > CAP else 0.05)[0]:
                break
        else:
            conn.sendall(b"0\r\n\r\n")
        answer = b""
        while piece := conn.recv(65536):
            answer += piece
            if b"\r\n\r\n" in answer and answer.rstrip().endswith(b"}"):
                break
    return answer


def test_a_chunked_body_over_the_cap_gets_413(port):
    answer = _chunked_post(port, json.dumps({"messages": HI, "user": "x" * 2 * CAP}).encode())
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "invalid_request_error" and "over 1 MiB" in error["message"]


def test_a_chunked_body_under_the_cap_is_read(port):
    # a whole chat request, chunked: past the cap check, it reaches the engine (still loading)
    answer = _chunked_post(port, json.dumps({"messages": HI}).encode(), piece=8)
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]


def test_a_declared_body_over_the_cap_gets_413(port):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Length: %d\r\n\r\n" % (CAP + 1))
        assert conn.recv(4096).startswith(b"HTTP/1.1 413")


def test_an_internal_error_is_a_fixed_500_with_a_request_id(port, monkeypatch, caplog):
    from adaspark.server.schemas import ChatRequest

    def broken(self):
        raise RuntimeError("secret detail /srv/adaspark/store.json")

    monkeypatch.setattr(ChatRequest, "check_supported", broken)
    with caplog.at_level("ERROR", logger="adaspark.server"):
        response = _post(port, json.dumps({"messages": HI}))
    assert response.status_code == 500
    error = _error(response)
    assert error["type"] == "server_error"
    request_id = re.fullmatch(r"internal server error \(request (req_[0-9a-f]{16})\); "
                              r"the server's log has the details", error["message"])[1]
    assert response.headers["x-request-id"] == request_id
    assert "secret" not in response.text and "RuntimeError" not in response.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1])


def test_openapi_declares_the_error_responses(port):
    doc = httpx.get(f"http://127.0.0.1:{port}/openapi.json", headers=AUTH).json()
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    for status in ("400", "401", "413", "429", "500", "503"):
        declared = chat["responses"][status]
        assert declared["content"]["application/json"]["schema"] == error_ref
        assert declared["description"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in body["required"] and "$ref" not in json.dumps(body)
    assert "401" in doc["paths"]["/v1/models"]["get"]["responses"]
    assert "401" in doc["paths"]["/metrics"]["get"]["responses"]  # not --public-metrics
    for open_path in ("/health", "/dashboard", "/dashboard/static/{name}"):
        assert "401" not in doc["paths"][open_path]["get"]["responses"]
    assert set(doc["paths"]["/health"]["get"]["responses"]) >= {"500", "503"}
    # the declared schema is the shape every error has
    schemas = doc["components"]["schemas"]
    detail = schemas[schemas["ErrorResponse"]["properties"]["error"]["$ref"].rsplit("/", 1)[1]]
    refused = _error(_post(port, "{}"))
    assert set(detail["properties"]) == set(refused)


def test_a_streamed_internal_error_says_nothing_of_the_exception(caplog):
    # what a stream sends when its reply fails after the 200 went out (app._sse_choice)
    from adaspark.server.errors import internal_error

    with caplog.at_level("ERROR", logger="adaspark.server"):
        request_id, body = internal_error(ValueError("secret /srv/x"), "streaming chatcmpl-1")
    assert body["error"]["type"] == "server_error" and request_id in body["error"]["message"]
    assert "secret" not in json.dumps(body) and "ValueError" not in json.dumps(body)
    (record,) = [r for r in caplog.records if request_id in r.getMessage()]
    assert "streaming chatcmpl-1" in record.getMessage() and record.exc_info[0] is ValueError


def test_the_documented_body_excludes_what_the_server_refuses(port):
    # a client (or a fuzzer) that follows the document is not refused for these: each value the
    # server answers 400 is outside the field's documented schema
    doc = httpx.get(f"http://127.0.0.1:{port}/openapi.json", headers=AUTH).json()
    props = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]
    with_content, with_calls = props["messages"]["items"]["anyOf"]
    refused = {
        "messages": [{"role": "user", "content": None}],
        "stop": [""],
        "response_format": {"type": "yaml"},
        "tool_choice": "required",
    }
    for field, value in refused.items():
        body = {"messages": HI, field: value}
        assert _post(port, json.dumps(body)).status_code == 400, field
    assert {"type": "null"} not in with_content["properties"]["content"]["anyOf"]
    assert "content" in with_content["required"]
    assert with_calls["properties"]["role"] == {"const": "assistant"}
    assert with_calls["properties"]["tool_calls"]["minItems"] == 1
    assert props["stop"]["anyOf"][1]["items"]["minLength"] == 1
    assert [kind["properties"]["type"] for kind in props["response_format"]["anyOf"][:3]] == [
        {"const": "text"}, {"const": "json_object"}, {"const": "json_schema"}]
    assert "required" not in props["tool_choice"]["anyOf"][0]["enum"]


def test_a_client_that_leaves_mid_body_is_no_internal_error(port, caplog):
    with caplog.at_level("INFO", logger="adaspark.server"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                         b"Content-Length: 100\r\n\r\n" + b'{"messages"')
        deadline = time.monotonic() + 30
        while not any("client left" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the server never saw the client leave"
            time.sleep(0.05)
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
