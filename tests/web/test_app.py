"""The served page: ``somatize serve`` as a process of its own, asked over a real
socket — its routes, its event streams, what it refuses, and that it writes nothing."""

import json
import secrets
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import quote

import pytest
from webruns import recorded, served, snapshot

from somatize import Graph, Node
from somatize.record import Recorder
from somatize.store import Store
from somatize.web import _app

httpx = pytest.importorskip("httpx")
pytest.importorskip("plotly")

DYING = {"body": {"act_zero": 1.0, "grad_norm": 1.0}, "head": {"grad_norm": 1.0}}
ODD = "a<b>&'c\" d{{plotly}}"  # a run name a page must escape and a URL must quote


class Step(Node):
    def forward(self, x, ctx):
        return x + 1


def client():
    return httpx.Client(trust_env=False, timeout=30)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    where = tmp_path_factory.mktemp("site") / "store"
    store = Store(where, durable=False)
    recorded(store, "r", 12, health=DYING)
    recorded(store, ODD, 2)
    with served(str(where)) as url:
        yield url, store, where


def events(url, kinds, until, timeout=30):
    """The server-sent events of ``url`` as ``(seconds since asked, kind, data)``, read
    until ``until(seen)`` holds."""
    seen, began = [], time.monotonic()
    with client().stream("GET", url, timeout=timeout) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind in kinds:
                seen.append((time.monotonic() - began, kind, json.loads(line[6:])))
                if until(seen):
                    return seen
            if time.monotonic() - began > timeout:
                raise AssertionError(f"not seen within {timeout} s: {[k for _, k, _ in seen]}")
    return seen


def test_the_runs_as_json(site):
    url, store, _ = site
    rows = client().get(f"{url}/api/runs").json()
    assert [row["name"] for row in rows] == [ODD, "r"]
    assert rows[1]["forwards"] == 12 and rows[1]["findings"] == [
        {"where": "body", "what": "dying", "since": 1}]


def test_one_run_as_json(site):
    url, store, _ = site
    answer = client().get(f"{url}/api/run/r").json()
    assert answer["state"]["forwards"] == 12 and len(answer["state"]["points"]) == 12
    assert [s["key"] for s in answer["sections"]["sections"]] == ["progress", "health", "graph", "spent"]
    assert client().get(f"{url}/api/run/{quote(ODD, safe='')}").json()["state"]["run"] == ODD


def test_an_unknown_run_is_404_naming_the_runs_there(site):
    url, *_ = site
    for path in ("/run/nope", "/api/run/nope", "/events/run/nope"):
        answer = client().get(url + path)
        assert answer.status_code == 404 and "no run 'nope'" in answer.text and "r" in answer.text


def test_the_pages_escape_what_they_show(site):
    url, *_ = site
    page = client().get(f"{url}/run/{quote(ODD, safe='')}")
    assert page.status_code == 200 and ODD not in page.text
    assert "a&lt;b&gt;&amp;&#x27;c&quot; d{{plotly}}" in page.text
    assert page.text.count("plotly.js") == 1  # the slot in the name stayed text
    front = client().get(url + "/").text
    assert 'data-page="runs"' in front and "plotly.js" not in front  # the list draws nothing


def test_the_assets(site):
    url, *_ = site
    script = client().get(f"{url}/static/plotly.js")
    assert script.status_code == 200 and len(script.content) > 1_000_000
    assert "javascript" in script.headers["content-type"]
    assert "EventSource" in client().get(f"{url}/static/page.js").text
    assert client().get(f"{url}/static/secrets.txt").status_code == 404


def test_only_reads_are_answered(site):
    url, *_ = site
    for method in ("POST", "PUT", "DELETE"):
        assert client().request(method, f"{url}/api/runs").status_code == 405


def test_a_request_for_another_host_is_refused(site):
    """What a page elsewhere gets when it reaches this server through DNS rebinding."""
    url, *_ = site
    answer = client().get(f"{url}/api/runs", headers={"Host": "attacker.example:8765"})
    assert answer.status_code == 421 and "loopback" in answer.text
    assert client().get(f"{url}/api/runs", headers={"Host": "localhost:8765"}).status_code == 200


def test_a_new_forward_reaches_an_open_page_within_a_second_or_two(site):
    url, store, _ = site
    g = Graph.somatize(Step().named("step"))
    recorder = Recorder(store, run="grow", summarising=["loss"])
    g.forward(0, watching=recorder)
    recorder({"fact": "loss", "value": 1.0})
    recorder.flush()  # written with its loss, as a Trainer's step is
    said = {}

    def later():
        time.sleep(3)  # the stream is open and has said the run as it was
        said["at"] = time.monotonic()
        g.forward(1, watching=recorder)
        recorder({"fact": "loss", "value": 0.5})
        recorder.flush()

    writer = threading.Thread(target=later)
    writer.start()
    seen = events(f"{url}/events/run/grow", {"state"},
                  lambda seen: seen[-1][2]["points"][-1:] == [[1, 0.5]], timeout=60)
    arrived = time.monotonic()
    writer.join()
    recorder.close()
    assert seen[0][2]["forwards"] == 1 and seen[0][2]["points"] == [[0, 1.0]]
    assert seen[-1][2]["points"] == [[1, 0.5]]  # only what is new
    took = arrived - said["at"]
    print(f"a new forward reached the page {took:.2f} s after it was bound")
    assert took < 5  # a liveness bound; the design is under a second (looks every 0.5 s)


def test_the_run_list_streams_a_new_run(site):
    url, store, _ = site

    def later():
        time.sleep(1.5)
        recorded(store, "appeared", 1)

    writer = threading.Thread(target=later)
    writer.start()
    seen = events(f"{url}/events/runs", {"runs"},
                  lambda seen: "appeared" in [row["name"] for row in seen[-1][2]], timeout=60)
    writer.join()
    assert "appeared" not in [row["name"] for row in seen[0][2]]


def test_a_session_leaves_the_store_as_it_was(tmp_path):
    where = tmp_path / "store"
    store = Store(where, durable=False)
    recorded(store, "r", 12, health=DYING)
    before = snapshot(where)
    with served(str(where)) as url:
        http = client()
        for path in ("/", "/run/r", "/api/runs", "/api/run/r", "/static/page.js", "/run/none"):
            http.get(url + path)
        events(f"{url}/events/run/r", {"state", "sections"}, lambda seen: len(seen) >= 2)
        events(f"{url}/events/runs", {"runs"}, lambda seen: len(seen) >= 1)
    assert snapshot(where) == before


def test_a_bucket_store_is_served(s3_endpoint, credentials):
    pytest.importorskip("boto3")
    from s3server import make_bucket, raw_client

    bucket = "soma-serve-" + secrets.token_hex(4)
    make_bucket(s3_endpoint, bucket)
    recorded(Store.on_bucket(s3_endpoint, bucket), "on-a-bucket", 4, health=DYING)

    def keys():
        listed = raw_client(s3_endpoint).list_objects_v2(Bucket=bucket).get("Contents", [])
        return {item["Key"]: item["ETag"] for item in listed}

    before = keys()
    with served(f"s3://{bucket}", "--endpoint", s3_endpoint) as url:
        rows = client().get(f"{url}/api/runs").json()
        assert [(row["name"], row["forwards"]) for row in rows] == [("on-a-bucket", 4)]
        assert client().get(f"{url}/api/run/on-a-bucket").json()["state"]["forwards"] == 4
    assert keys() == before  # not even the probe a writer's Store.on_bucket makes


def serve(*arguments):
    return subprocess.run([sys.executable, "-m", "somatize", "serve", *arguments],
                          capture_output=True, text=True, timeout=60)


def test_another_address_needs_a_flag_that_says_so(tmp_path):
    Store(tmp_path / "store")
    done = serve(str(tmp_path / "store"), "--host", "0.0.0.0")
    assert done.returncode == 2 and "--public" in done.stderr and "0.0.0.0" in done.stderr
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        _app.check_host(host, public=False)
    for host in ("0.0.0.0", "192.168.1.7", "::", "example.com"):
        with pytest.raises(PermissionError, match="--public"):
            _app.check_host(host, public=False)
        _app.check_host(host, public=True)


def test_what_cannot_be_served_is_said_in_one_line(tmp_path):
    (tmp_path / "plain").mkdir()
    done = serve(str(tmp_path / "plain"))
    assert done.returncode == 2 and "not a store" in done.stderr and "Traceback" not in done.stderr
    done = serve(str(tmp_path / "missing"))
    assert done.returncode == 2 and "no store at" in done.stderr
    Store(tmp_path / "store")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        done = serve(str(tmp_path / "store"), "--port", str(taken.getsockname()[1]))
    assert done.returncode == 2 and "cannot listen on 127.0.0.1" in done.stderr
    done = serve("s3://", "--endpoint", "http://127.0.0.1:9")
    assert done.returncode == 2 and "names no bucket" in done.stderr
