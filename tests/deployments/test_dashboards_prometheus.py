"""Every dashboard query, run by a real Prometheus scraping the SmolLM2 app after it served
requests, returns at least one series."""

import pytest

from spin_cluster.deployments import dashboards

from .conftest import prometheus_query, requests_while_scraped, wait_for_series

# A real Serve cluster; the timeout (which includes starting it) stops a hang, not a slow run.
pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]

# Grafana's variables as Grafana would fill them: the served model, a window of several scrapes.
VARIABLES = {"$model_name": "smollm2", "$__rate_interval": "1m"}


def _expand(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable the test does not fill: {expr}"
    return expr


def test_every_dashboard_query_returns_a_series(spin_app, prometheus):
    base, _ = spin_app
    requests_while_scraped(base, prometheus, num_requests=2, max_tokens=4)
    wait_for_series(prometheus, 'spin_buffer_hits_total{model_name="smollm2"} > 0', timeout_s=30)

    empty = []
    for name, board in dashboards.load_dashboards().items():
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":  # label_values(METRIC, LABEL)
                metric, label = variable["definition"].removeprefix("label_values(").rstrip(")").split(", ")
                series = wait_for_series(prometheus, metric, timeout_s=10)
                assert {s["metric"][label] for s in series} == {"smollm2"}
        for expr in dashboards.panel_queries(board):
            if not prometheus_query(prometheus, _expand(expr)):
                empty.append(f"{name}: {expr}")
    assert empty == []
