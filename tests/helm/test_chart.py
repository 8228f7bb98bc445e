"""The Helm chart, rendered offline by Helm's own Go SDK (helm-python-sdk: no helm binary, no
cluster), for the default values and for a 2-node 8-GPU values file."""

import json
import math
import re
import subprocess
import tomllib
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from spin_cluster.config import SpinConfig
from spin_cluster.deployments import dashboards
from spin_cluster.deployments.app import IMPORT_PATH, deploy_config
from spin_cluster.deployments.settings import CONFIG_DIR, ServeOptions, load_app_config

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "spin-cluster"
TWO_NODES = CHART / "ci" / "two-nodes-8-gpus-values.yaml"
KUBE_VERSION = "1.30.0"
BUILT_IN = {"Service", "ConfigMap", "NetworkPolicy"}
# KubeRay's limit: the RayCluster it creates appends 6 characters to a 53-character maximum.
MAX_RAYSERVICE_NAME = 47


def _two_node_values() -> dict:
    return yaml.safe_load(TWO_NODES.read_text())


def render(values: dict | None = None, release: str = "spin") -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=release, namespace="llm")
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@pytest.fixture(scope="module", params=["default", "two-nodes-8-gpus"])
def case(request) -> tuple[dict, list[dict]]:
    values = {} if request.param == "default" else _two_node_values()
    return values, render(values)


def _one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind
             and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, f"{len(found)} {kind} ({component})"
    return found[0]


def _templates(rayservice: dict) -> list[dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def _serve_config(docs: list[dict]) -> dict:
    return yaml.safe_load(_one(docs, "RayService")["spec"]["serveConfigV2"])


# ---- the chart as Helm sees it -----------------------------------------------------------

@pytest.mark.parametrize("values_file", [None, TWO_NODES], ids=["default", "two-nodes-8-gpus"])
def test_lint_is_clean(values_file):
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert problems == [], problems


def test_kinds_rendered():
    assert sorted(d["kind"] for d in render()) == ["ConfigMap"] * 3 + ["RayService", "Service"]
    kinds = sorted({d["kind"] for d in render(_two_node_values())})
    assert kinds == ["ConfigMap", "NetworkPolicy", "RayService", "Service", "ServiceMonitor"]
    pod_monitor = {"monitoring": {"podMonitor": {"enabled": True}}}
    assert "PodMonitor" in {d["kind"] for d in render(pod_monitor)}


def test_built_in_kinds_pass_strict_kubernetes_validation(case):
    _, docs = case
    for doc in docs:
        if doc["kind"] in BUILT_IN:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    # The Ray pods: each group's template as the Pod KubeRay will create from it.
    for template in _templates(_one(docs, "RayService")):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": "ray"},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)


def test_strict_validation_catches_a_misspelled_field():
    service = _one(render(), "Service")
    service["spec"]["ports"][0]["targetport"] = "serve"
    with pytest.raises(kubernetes_validate.ValidationError, match="targetport"):
        kubernetes_validate.validate(service, KUBE_VERSION, strict=True)


# ---- the RayService ----------------------------------------------------------------------

def test_rayservice_has_the_fields_kuberay_requires(case):
    values, docs = case
    rs = _one(docs, "RayService")
    assert rs["apiVersion"] == "ray.io/v1"
    name = rs["metadata"]["name"]
    assert len(name) <= MAX_RAYSERVICE_NAME and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    spec = rs["spec"]
    assert isinstance(spec["serveConfigV2"], str)
    cluster = spec["rayClusterConfig"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", cluster["rayVersion"])
    # Scaling is Serve's engine count; Ray's autoscaler brings the GPU pods for it.
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["securityContext"]["allowPrivilegeEscalation"] is False
    head = cluster["headGroupSpec"]
    assert "headService" not in head
    groups = [head, *cluster["workerGroupSpecs"]]
    for group in groups:
        assert group["template"]["spec"]["containers"], "the Ray container comes first"
        params = group["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values()), params  # map[string]string
        assert "labels" not in params
    workers = cluster["workerGroupSpecs"]
    assert len({g["groupName"] for g in workers}) == len(workers)
    expected_workers = values.get("workers", {}).get("replicas", 1)
    for g in workers:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert g["replicas"] == expected_workers


def test_more_engines_than_the_autoscaler_may_start_is_refused():
    with pytest.raises(helm.HelmRenderError, match=r"workers\.replicas=5 exceeds workers\.maxReplicas=4: "
                                                   r"raise workers\.maxReplicas"):
        render({"workers": {"replicas": 5}})


def test_long_release_names_fit_kuberays_limit():
    rs = _one(render(release="a-very-long-release-name-for-the-spin-cluster-chart"), "RayService")
    assert len(rs["metadata"]["name"]) <= MAX_RAYSERVICE_NAME


def test_gpu_workers_two_nodes_of_eight():
    rs = _one(render(_two_node_values()), "RayService")
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["replicas"] == 2
    spec = group["template"]["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["models"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]


def test_default_model_comes_from_a_read_only_pvc():
    rs = _one(render(), "RayService")
    for template in _templates(rs):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "spin-cluster-models", "readOnly": True}


def test_pods_run_as_non_root(case):
    _, docs = case
    for template in _templates(_one(docs, "RayService")):
        pod_ctx = template["spec"]["securityContext"]
        assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] > 0
        for container in template["spec"]["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]


def test_ray_workers_run_at_normal_priority(case):
    """Non-root pods cannot lower a nice value, so Ray must not raise its workers' (15 by
    default): the engine would yield the CPU to every other process of the pod."""
    _, docs = case
    for template in _templates(_one(docs, "RayService")):
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_worker_niceness"] == "0"
        assert env["THP_MEM_ALLOC_ENABLE"] == "1"  # huge pages under the weights and KV pool


@pytest.mark.parametrize("overrides, drain_s", [({}, ServeOptions().drain_s), ({"serve": {"drain_s": 45}}, 45),
                                                ({"serve": {"drain_s": 7.5}}, 7.5)])
def test_pods_drain_for_serve_drain_s_and_get_10_s_more(overrides, drain_s):
    """SIGTERM to a pod: Ray drains its node for serve.drain_s, and the kubelet waits 10 s
    more before it kills the pod."""
    for template in _templates(_one(render({"app": {"overrides": overrides}}), "RayService")):
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]) == drain_s
        assert template["spec"]["terminationGracePeriodSeconds"] == math.ceil(drain_s) + 10


def test_http_service_selects_the_serving_ray_pods(case):
    _, docs = case
    service = _one(docs, "Service", "http")
    selector = dict(service["spec"]["selector"])
    assert selector.pop("ray.io/serve") == "true"  # KubeRay's label on pods with a healthy proxy
    for template in _templates(_one(docs, "RayService")):
        assert selector.items() <= template["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports[service["spec"]["ports"][0]["targetPort"]] == 8000


def test_service_monitor_scrapes_the_head_only():
    docs = render(_two_node_values())
    metrics = _one(docs, "Service", "metrics")
    assert metrics["spec"]["selector"]["ray.io/node-type"] == "head"
    monitor = _one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == metrics["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_hplb_profile_is_a_configmap_mounted_in_every_ray_pod():
    values = _two_node_values()
    docs = render(values)
    config_map = _one(docs, "ConfigMap", "hplb")
    assert json.loads(config_map["data"]["profile.json"]) == json.loads(values["hplb"]["profile"])
    for template in _templates(_one(docs, "RayService")):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["hplb-profile"]["configMap"]["name"] == config_map["metadata"]["name"]
        mounts = {m["name"]: m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["hplb-profile"] == "/etc/spin-cluster/hplb"
    (app,) = _serve_config(docs)["applications"]
    assert app["args"]["serve"]["hplb_profile"] == "/etc/spin-cluster/hplb/profile.json"  # the planner reads it
    assert not [d for d in render() if d["metadata"]["name"].endswith("-hplb")]
    assert "hplb_profile" not in _serve_config(render())["applications"][0]["args"]["serve"]


# ---- serveConfigV2: the local mode's config ----------------------------------------------

def test_serve_config_passes_rays_serve_schema(case):
    from ray.serve.schema import ServeDeploySchema

    _, docs = case
    ServeDeploySchema.model_validate(_serve_config(docs))


def test_serve_config_is_deploy_config_of_the_bundled_app_config(case):
    values, docs = case
    cfg = _serve_config(docs)
    (app,) = cfg["applications"]
    assert app["import_path"] == IMPORT_PATH
    assert cfg == deploy_config(app["args"], name=app["name"], route_prefix=app["route_prefix"])
    # The same settings `spin-cluster serve --config NAME --model PATH` runs, plus the chart's
    # overrides and the engines' shape: no engine setting is copied into the chart.
    app_values = values.get("app", {})
    overrides = app_values.get("overrides", {})
    model_path = f"/models/{values.get('model', {}).get('folder', 'SmolLM2-135M-Instruct')}"
    local = load_app_config({"config": app_values.get("config", "default"), "model": {"path": model_path}})
    chart = load_app_config(app["args"])
    engine_sections = {k: v for k, v in overrides.items() if k != "serve"}
    assert chart.spin == local.spin.replace(**engine_sections)
    workers = values.get("workers", {})
    shape = {"num_engine_replicas": workers.get("replicas", 1), "engine_num_gpus": workers.get("gpusPerPod", 1)}
    served = values.get("model", {}).get("servedName")
    if served:
        shape["model_name"] = served
    if values.get("hplb", {}).get("profile"):
        shape["hplb_profile"] = "/etc/spin-cluster/hplb/profile.json"
    assert chart.serve == local.serve.model_copy(update={**overrides.get("serve", {}), **shape})


def test_schema_knows_the_bundled_configs_and_the_app_sections():
    schema = json.loads((CHART / "values.schema.json").read_text())
    app = schema["properties"]["app"]["properties"]
    assert sorted(app["config"]["enum"]) == sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    sections = set(SpinConfig.model_fields) | {"serve"}
    assert set(app["overrides"]["properties"]) == sections, "list the app config's sections under " \
        "app.overrides in helm/spin-cluster/values.schema.json"


def test_chart_app_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


# ---- values that the chart refuses -------------------------------------------------------

BAD_VALUES = {
    "workers:\n  replicas: 0\n": "at '/workers/replicas': minimum: got 0, want 1",
    "workers:\n  gpus: 8\n": "additional properties 'gpus' not allowed",
    "app:\n  config: spin-qeust\n": "at '/app/config': value must be one of 'default', 'spin', 'spin-fast', 'spin-quest'",
    "app:\n  overrides:\n    cahce: {page_size: 32}\n": "additional properties 'cahce' not allowed",
    "model:\n  source: hostPath\n": "at '/model/hostPath/path'",
    "podSecurityContext:\n  runAsNonRoot: false\n": "at '/podSecurityContext/runAsNonRoot': value must be true",
    "monitoring:\n  serviceMonitor: {enabled: true}\n  podMonitor: {enabled: true}\n":
        "at '/monitoring/podMonitor/enabled': value must be false",
}


@pytest.mark.parametrize("text", BAD_VALUES, ids=lambda t: t.split(":")[0])
def test_a_values_file_that_breaks_the_schema_is_rejected_clearly(tmp_path, text):
    values_file = tmp_path / "values.yaml"
    values_file.write_text(text)
    values = helm.values_from_yaml(values_file.read_text())
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as err:
        chart.render(values, name="spin")
    assert BAD_VALUES[text] in str(err.value)


def test_chart_owned_app_keys_cannot_be_overridden():
    with pytest.raises(helm.HelmRenderError, match=r"app\.overrides\.serve\.engine_num_gpus is set by the chart "
                                                   r"from workers\.gpusPerPod; remove it"):
        render({"app": {"overrides": {"serve": {"engine_num_gpus": 4}}}})


# ---- dashboards --------------------------------------------------------------------------

def test_one_labelled_configmap_per_dashboard(case):
    _, docs = case
    maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    packaged = dashboards.load_dashboards()
    assert len(maps) == len(packaged)
    for config_map in maps:
        ((key, text),) = config_map["data"].items()
        assert json.loads(text) == packaged[key.removesuffix(".json")]


def test_the_chart_holds_the_only_copy_of_each_dashboard():
    # The package's grafana/ is a link to the chart's folder: one file per dashboard in the tree.
    assert dashboards.DASHBOARD_DIR.is_symlink()
    assert dashboards.DASHBOARD_DIR.resolve() == (CHART / "dashboards").resolve()
    assert [p.name for p in dashboards.dashboard_files()] == sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "*.json"], capture_output=True, text=True)
    if tracked.returncode != 0:  # a copy of the tree without .git
        return
    boards = [p for p in tracked.stdout.split() if not p.startswith("benchmarks/results/")
              and '"panels"' in (REPO / p).read_text() and '"schemaVersion"' in (REPO / p).read_text()]
    assert sorted(boards) == sorted(f"helm/spin-cluster/dashboards/{p.name}" for p in dashboards.dashboard_files())


# ---- the deploy state in the head pod's log ------------------------------------------------

def test_the_head_pod_logs_the_deploy_state_in_a_container_of_its_own(case):
    values, docs = case
    templates = _templates(_one(docs, "RayService"))
    head = {c["name"]: c for c in templates[0]["spec"]["containers"]}
    watch = head["deploy-status"]
    app = values.get("app", {}).get("name", "spin")
    assert watch["command"] == ["spin-cluster", "watch-deploy", "--app", app, "--dashboard",
                                "http://127.0.0.1:8265", "--poll-s", "5"]
    assert watch["image"] == head["ray-head"]["image"]
    assert watch["securityContext"] == head["ray-head"]["securityContext"]
    assert "nvidia.com/gpu" not in watch["resources"]["limits"]
    # the CLI takes what the chart passes (a typo in the command would crash-loop the container)
    from spin_cluster.cli import _parser

    args = _parser().parse_args(watch["command"][1:])
    assert (args.app, args.dashboard, args.poll_s) == (app, "http://127.0.0.1:8265", 5.0)
    for worker in templates[1:]:
        assert [c["name"] for c in worker["spec"]["containers"]] == ["ray-worker"]


def test_the_deploy_status_container_can_be_left_out():
    head = _templates(_one(render({"deployStatus": {"enabled": False}}), "RayService"))[0]
    assert [c["name"] for c in head["spec"]["containers"]] == ["ray-head"]
