"""The Grafana dashboards: metric names against the app's exporter, structure, and the
``spin-cluster dashboards`` command (push against a small fake Grafana over real HTTP)."""

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spin_cluster.cli import main
from spin_cluster.deployments import dashboards
from spin_cluster.deployments.messages import ClusterStats
from spin_cluster.deployments.metrics import ServingMetrics

from .conftest import free_port

METRIC = re.compile(r"\bspin_[a-z0-9_]+")
SAMPLE_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")
MODEL_FILTER = '{model_name=~"$model_name"'


def _exported() -> dict[str, set[str]]:
    """Family name -> sample names, from the exporter /metrics serves once an engine has
    reported (per-engine series need one); without the creation timestamps (``*_created``)
    prometheus_client adds beside counters and histograms."""
    text = ServingMetrics("m").render(ClusterStats(requests_by_engine={"replica-1": 0})).decode()
    return {f.name: {s.name for s in f.samples} for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")}


def _dashboard_metrics() -> set[str]:
    names = set()
    for board in dashboards.load_dashboards().values():
        texts = dashboards.panel_queries(board) + [v.get("definition", "") for v in board["templating"]["list"]]
        names.update(m for text in texts for m in METRIC.findall(text))
    return names


def _unknown(used: set[str], exported: dict[str, set[str]]) -> set[str]:
    samples = set().union(*exported.values())
    return used - samples


def _unshown(used: set[str], exported: dict[str, set[str]]) -> set[str]:
    return {family for family in exported if not {family + s for s in SAMPLE_SUFFIXES} & used}


def test_dashboards_read_exactly_the_exported_metrics():
    exported, used = _exported(), _dashboard_metrics()
    assert _unknown(used, exported) == set(), "panels read metrics the app does not export"
    assert _unshown(used, exported) == set(), "exported metrics that no panel shows"


def test_the_name_check_can_fail():
    exported = _exported()
    assert _unknown({"spin_buffer_hit_total", "spin_buffer_hits_total"}, exported) == {"spin_buffer_hit_total"}
    assert _unshown({"spin_buffer_hits_total"}, exported) >= {"spin_buffer_lookups", "spin_kv_pages"}


def test_required_panels():
    boards = dashboards.load_dashboards()
    assert set(boards) == {"serving", "kv-memory", "head-parallel"}
    serving = " ".join(dashboards.panel_queries(boards["serving"]))
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(spin_{histogram}_seconds_bucket" in serving
    for metric in ("spin_generation_tokens_total", "spin_requests_running", "spin_requests_waiting"):
        assert metric in serving
    kv = " ".join(dashboards.panel_queries(boards["kv-memory"]))
    for metric in ("spin_buffer_hits_total", "spin_kv_pages", "spin_metadata_bytes", "spin_retrieved_bytes_total",
                   "spin_evicted_pages_total", "spin_prefix_cache_queries_total", "spin_prefix_cache_hits_total",
                   "spin_kv_bytes", "spin_spilled_pages_total", "spin_promoted_pages_total", "spin_num_preemptions_total"):
        assert metric in kv
    hp = " ".join(dashboards.panel_queries(boards["head-parallel"]))
    for metric in ("spin_attention_rank_seconds_total", "spin_attention_bubble_seconds_total",
                   "spin_head_placement_imbalance"):
        assert metric in hp


@pytest.mark.parametrize("name", ["serving", "kv-memory", "head-parallel"])
def test_dashboard_structure(name):
    board = dashboards.load_dashboards()[name]
    assert board["id"] is None and len(board["uid"]) <= 40
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["allValue"] == ".*"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            # every series the panel reads is filtered by the model variable
            for match in METRIC.finditer(target["expr"]):
                assert target["expr"][match.end():].startswith(MODEL_FILTER), target["expr"]
    uids = [b["uid"] for b in dashboards.load_dashboards().values()]
    assert len(set(uids)) == len(uids)


def test_export_writes_the_packaged_files(tmp_path, capsys):
    assert main(["dashboards", "export", str(tmp_path / "out")]) == 0
    written = sorted((tmp_path / "out").glob("*.json"))
    assert [p.name for p in written] == [p.name for p in dashboards.dashboard_files()]
    assert all(p.read_bytes() == (dashboards.DASHBOARD_DIR / p.name).read_bytes() for p in written)
    assert capsys.readouterr().out.split() == [str(p) for p in written]


def test_folder_uid():
    assert dashboards.folder_uid("Spin cluster / LLM") == "spin-cluster-llm"
    with pytest.raises(ValueError, match="at least one letter or digit"):
        dashboards.folder_uid("//")


# ---- push, against a fake Grafana ---------------------------------------------------------

TOKEN = "glsa_test_token"


class FakeGrafana(BaseHTTPRequestHandler):
    """The three endpoints `push` calls: folder lookup, folder creation, dashboard upsert."""

    folders: dict[str, str]
    dashboards: list[dict]
    calls: list[tuple[str, str]]
    basic = "admin:admin"  # user:password accepted besides the token

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        self.calls.append((self.command, self.path))
        accepted = {f"Bearer {TOKEN}", "Basic " + base64.b64encode(self.basic.encode()).decode()}
        if self.headers.get("Authorization") in accepted:
            return True
        self._reply(401, {"message": "Unauthorized"})
        return False

    def _body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if not self._authorized():
            return
        uid = self.path.removeprefix("/api/folders/")
        if self.path.startswith("/api/folders/") and uid in self.folders:
            self._reply(200, {"uid": uid, "title": self.folders[uid]})
        else:
            self._reply(404, {"message": "folder not found"})

    def do_POST(self):  # noqa: N802
        if not self._authorized():
            return
        body = self._body()
        if self.path == "/api/folders":
            self.folders[body["uid"]] = body["title"]
            self._reply(200, {"uid": body["uid"], "title": body["title"]})
        elif self.path == "/api/dashboards/db":
            self.dashboards.append(body)
            uid = body["dashboard"]["uid"]
            self._reply(200, {"status": "success", "uid": uid, "url": f"/d/{uid}/x", "version": 1})
        else:
            self._reply(404, {"message": "not found"})

    def log_message(self, *args):
        pass


@pytest.fixture
def grafana():
    handler = type("Handler", (FakeGrafana,), {"folders": {}, "dashboards": [], "calls": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_push_creates_the_folder_and_uploads_every_dashboard(grafana, capsys):
    url, state = grafana
    assert main(["dashboards", "push", "--url", url, "--token", TOKEN, "--folder", "Spin cluster"]) == 0
    assert state.folders == {"spin-cluster": "Spin cluster"}
    packaged = dashboards.load_dashboards()
    assert len(state.dashboards) == len(packaged)
    for body in state.dashboards:
        assert body["folderUid"] == "spin-cluster" and body["overwrite"] is True
        assert body["dashboard"] == packaged[_stem(body["dashboard"]["uid"])]
    out = capsys.readouterr().out.split()
    assert sorted(out) == sorted(f"{url}/d/{b['uid']}/x" for b in packaged.values())

    # Again: the folder exists now, the dashboards are overwritten.
    state.calls.clear()
    assert main(["dashboards", "push", "--url", url, "--token", TOKEN, "--folder", "Spin cluster"]) == 0
    assert ("POST", "/api/folders") not in state.calls
    assert len(state.dashboards) == 2 * len(packaged)


def test_push_to_the_general_folder(grafana):
    url, state = grafana
    assert main(["dashboards", "push", "--url", url, "--token", TOKEN, "--folder", ""]) == 0
    assert state.folders == {} and all("folderUid" not in b for b in state.dashboards)


def test_push_with_user_and_password_in_the_url(grafana, capsys):
    url, state = grafana
    state.basic = "admin:secret"
    with_credentials = url.replace("http://", "http://admin:secret@")
    assert main(["dashboards", "push", "--url", with_credentials]) == 0
    assert len(state.dashboards) == len(dashboards.dashboard_files())
    assert "secret" not in capsys.readouterr().out  # printed URLs carry no credentials


def test_push_with_a_wrong_token_says_what_to_do(grafana, capsys):
    url, state = grafana
    assert main(["dashboards", "push", "--url", url, "--token", "wrong"]) == 2
    err = capsys.readouterr().err
    assert "refused the credentials" in err and "--token" in err
    assert state.dashboards == []


def test_push_to_nothing_listening(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["dashboards", "push", "--url", url, "--token", TOKEN]) == 2
    assert f"cannot reach Grafana at {url}" in capsys.readouterr().err


def _stem(uid: str) -> str:
    return next(stem for stem, board in dashboards.load_dashboards().items() if board["uid"] == uid)
