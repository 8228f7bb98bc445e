"""Grafana dashboards over the app's /metrics series, and the `spin-cluster dashboards` command.

    spin-cluster dashboards export DIR                 write the dashboard JSON files into DIR
    spin-cluster dashboards push --url U [--token T]   create or update them in a Grafana

The JSON files live once, in the Helm chart (``helm/spin-cluster/dashboards/``: Helm's
``.Files`` sees only files inside the chart); ``grafana/`` beside this module is a link to that
folder, so the package ships them, ``export`` copies them and ``push`` uploads them. Panels
choose the Prometheus data source and the model through the dashboard variables
``datasource`` and ``model_name``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DASHBOARD_DIR = Path(__file__).resolve().parent / "grafana"
DEFAULT_FOLDER = "spin-cluster"
# Grafana's limit on a folder or dashboard uid.
_MAX_UID_CHARS = 40


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def load_dashboards() -> dict[str, dict[str, Any]]:
    """File stem (``serving``, ``kv-memory``, ...) -> dashboard JSON model."""
    return {path.stem: json.loads(path.read_text()) for path in dashboard_files()}


def panel_queries(dashboard: dict[str, Any]) -> list[str]:
    """The PromQL expression of every panel target, rows' nested panels included."""
    out = []
    queue = list(dashboard.get("panels", []))
    while queue:
        panel = queue.pop(0)
        queue.extend(panel.get("panels", []))
        out.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
    return out


def export(directory: str | Path) -> list[Path]:
    """Copy the dashboard files into ``directory`` (created if missing); returns the copies."""
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(path, out_dir / path.name)) for path in dashboard_files()]


def push(url: str, *, token: str | None = None, folder: str = DEFAULT_FOLDER, timeout_s: float = 30.0) -> list[str]:
    """Create or overwrite every dashboard in the Grafana at ``url``, inside ``folder`` (a
    title; created if missing; empty: the General folder). ``token``: a service-account
    token; without it, ``user:password@`` in the URL. Returns the dashboards' URLs."""
    try:
        from grafana_client import GrafanaApi
        from grafana_client.client import GrafanaException, GrafanaUnauthorizedError
        from niquests.exceptions import ConnectionError as NiquestsConnectionError
    except ImportError as e:
        raise ValueError("pushing dashboards needs grafana-client: pip install 'spin-cluster[k8s]'") from e

    api = GrafanaApi.from_url(url, credential=token or None, timeout=timeout_s)
    # Grafana answers each dashboard's path (with its sub-path, if any); no credentials printed.
    parts = urlsplit(url)
    origin = f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    try:
        target_uid = _ensure_folder(api, folder) if folder else None
        urls = []
        for dashboard in load_dashboards().values():
            body = {"dashboard": {**dashboard, "id": None}, "overwrite": True,
                    "message": "spin-cluster dashboards push"}
            if target_uid:
                body["folderUid"] = target_uid
            result = api.dashboard.update_dashboard(body)
            urls.append(origin + result["url"])
        return urls
    except GrafanaUnauthorizedError as e:
        raise ValueError(f"Grafana at {url} refused the credentials ({e.message}): pass --token "
                         "(or set GRAFANA_TOKEN) with an Editor service-account token, or put "
                         "user:password@ in the URL") from e
    except GrafanaException as e:
        raise ValueError(f"Grafana at {url} answered {e.status_code}: {e.message}") from e
    except NiquestsConnectionError as e:
        raise ValueError(f"cannot reach Grafana at {url}: {e}") from e


def _ensure_folder(api, title: str) -> str:
    from grafana_client.client import GrafanaClientError

    uid = folder_uid(title)
    try:
        api.folder.get_folder(uid)
    except GrafanaClientError as e:
        if e.status_code != 404:
            raise
        api.folder.create_folder(title, uid=uid)
    return uid


def folder_uid(title: str) -> str:
    """A stable uid for a folder title: lower case, runs of other characters as one '-'."""
    uid = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:_MAX_UID_CHARS]
    if not uid:
        raise ValueError(f"folder title {title!r} needs at least one letter or digit")
    return uid


def add_dashboards_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``dashboards`` on the ``add_subparsers()`` object of the main parser."""
    p = subparsers.add_parser("dashboards", help="export or push the Grafana dashboards",
                              description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(metavar="ACTION")
    exp = sub.add_parser("export", help="write the dashboard JSON files into DIR")
    exp.add_argument("directory", metavar="DIR")
    exp.set_defaults(func=_cmd_export)
    psh = sub.add_parser("push", help="create or update the dashboards in a Grafana (grafana-client)")
    psh.add_argument("--url", default=os.environ.get("GRAFANA_URL"), required="GRAFANA_URL" not in os.environ,
                     help="Grafana's base URL, e.g. http://grafana:3000 (default: $GRAFANA_URL)")
    psh.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                     help="service-account token (default: $GRAFANA_TOKEN; else user:password@ in the URL)")
    psh.add_argument("--folder", default=DEFAULT_FOLDER,
                     help="folder title, created if missing; '' for General (default: %(default)s)")
    psh.set_defaults(func=_cmd_push)
    return p


def _cmd_export(args: argparse.Namespace) -> int:
    for path in export(args.directory):
        print(path)
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    for url in push(args.url, token=args.token, folder=args.folder):
        print(url)
    return 0
