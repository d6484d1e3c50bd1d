"""``kvtier route``'s front door attacked once more (issue 24 follow-up), through real ``kvtier
route`` processes in front of the tests' stub engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import requests

from tests.route._stub_engine import StubEngine
from tests.route.test_front_door import Router
from tests.route.test_proxy import _word_tokenizer


@pytest.fixture(scope="module")
def stub():
    engine = StubEngine().start()
    yield engine
    engine.stop()


def test_a_huge_chat_is_tokenized_only_as_far_as_it_is_routed(stub, tmp_path):
    """A 16 MiB chat message was tokenized whole through the chat template (about 30 s here,
    holding the tokenizer every text and chat request waits for); now its messages are cut at
    8 characters per routed token like a text prompt. Bound: routed and answered within 5 s
    with max_route_tokens 1024, and the engine gets the whole body."""
    _word_tokenizer(tmp_path / "tok", "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}w2")
    r = Router(tmp_path, "chat", {"engines": [stub.url], "block_size": 4, "max_route_tokens": 1024,
                                   "tokenizer": str(tmp_path / "tok")})
    try:
        words = " ".join(f"w{i % 200}" for i in range(4_000_000))
        body = json.dumps({"messages": [{"role": "system", "content": "w1 w2"},
                                        {"role": "user", "content": words},
                                        {"role": "user", "content": words[:1000]}]})
        before = len(stub.seen)
        t0 = time.monotonic()
        resp = requests.post(r.base + "/v1/chat/completions", data=body, timeout=120,
                             headers={"Content-Type": "application/json"})
        took = time.monotonic() - t0
        assert resp.status_code == 200, resp.text
        assert took < 5.0, f"a 16 MiB chat took {took:.1f} s to route"
        assert len(stub.seen) == before + 1 and stub.seen[-1]["path"] == "/v1/chat/completions"
        assert "Traceback" not in r.text()
    finally:
        r.stop()


@pytest.fixture(scope="module")
def router(stub, tmp_path_factory):
    r = Router(tmp_path_factory.mktemp("attack"), "router", {"engines": [stub.url], "health_interval_s": 0.5})
    yield r
    r.stop()
    assert "Traceback" not in r.text(), r.text()[-3000:]


def test_an_engines_endless_model_list_is_cut_not_held(router, stub):
    """An engine answering /v1/models with 512 MiB was read whole into the router's memory;
    now the answer is at most 8 MiB (a 502 beyond). Bound: the router's RSS grows < 64 MiB."""
    import psutil

    proc = psutil.Process(router.child.popen.pid)
    assert requests.get(router.base + "/v1/models", timeout=10).json()["data"][0]["id"] == "stub"
    before = proc.memory_info().rss
    stub.models_bytes = 512 * 2**20
    try:
        resp = requests.get(router.base + "/v1/models", timeout=60)
    finally:
        stub.models_bytes = None
    grown = proc.memory_info().rss - before
    assert resp.status_code == 502 and "8 MiB" in resp.json()["error"]["message"], resp.text[:300]
    assert grown < 64 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB"
    assert router.health()["healthy"] == [stub.url]  # a long answer is not a dead engine


def test_an_engines_redirect_is_relayed_never_followed(router, stub):
    """An engine answering 307 to another host made the router re-send the client's prompt
    there (and follow same-origin redirects with the engine's credentials); now the 307 goes
    to the client as it came and nothing reaches the other host."""
    elsewhere = StubEngine().start()
    try:
        resp = requests.post(router.base + "/v1/completions", data=json.dumps({"prompt": "private words"}),
                             headers={"Content-Type": "application/json", "X-Stub": "redirect",
                                      "X-Stub-Location": elsewhere.url + "/v1/completions"},
                             allow_redirects=False, timeout=10)
        assert resp.status_code == 307 and resp.headers["Location"] == elsewhere.url + "/v1/completions"
        time.sleep(0.3)
        assert elsewhere.seen == [], elsewhere.seen
    finally:
        elsewhere.stop()
    assert router.in_flight() == 0 and router.health()["healthy"] == [stub.url]


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_a_tokenizer_that_does_not_load_is_one_line(stub, tmp_path, where):
    """``--tokenizer`` naming a missing or empty directory ended in a transformers traceback;
    now exit 2 with one line naming the path."""
    path = tmp_path / "tok"
    if where == "empty":
        path.mkdir()
    proc = subprocess.run([sys.executable, "-m", "kvtier", "route", "--engine", stub.url, "--port", "0",
                           "--tokenizer", str(path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("kvtier route: error: route.tokenizer:") and str(path) in lines[0], lines[0]


@pytest.mark.parametrize("password", ["1234#word", "99/word", "12?word"])
def test_credentials_with_an_unescaped_delimiter_are_refused_unshown(stub, password):
    """``http://alice:1234#word@host`` parses as host ``alice``, port 1234 and a fragment: the
    whole password was the engine's name in /health, metric labels and logs. Now exit 2 with
    one line that shows no part of it."""
    port = stub.url.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "kvtier", "route", "--port", "0", "--engine",
                           f"http://alice:{password}@127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and len(out.strip().splitlines()) == 1, out[-2000:]
    assert "percent-encode" in out and "word" not in out and password.split("word")[0][:-1] not in out, out
