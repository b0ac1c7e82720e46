"""The Kubernetes manifests and Helm chart (deploy/kubernetes/), rendered and checked offline.

* Every plain manifest parses (PyYAML), ``kubectl kustomize`` builds them, and ``kubectl create
  --dry-run=client`` takes them: kubectl needs the API server's *discovery* (which group and
  version serve which kind) even for a client-side dry run, so a discovery stub on 127.0.0.1
  answers it; nothing is sent to a cluster.
* The objects fit together: the DaemonSet mounts the kubelet's PodResources directory read-only
  and points ``--k8s-socket`` into it, shares the host's pids, asks for no GPU, and its metrics
  port is the one the Service, the ServiceMonitor, the annotations and ``--prometheus-port`` say.
* The chart, rendered with ``helm template`` (or Helm's own engine from the ``helm-python-sdk``
  wheel where no helm binary is installed), makes the same objects with the defaults, and
  follows its values (image, port, ServiceMonitor).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
CHART = K8S / "chart" / "zeus-async"
MANIFESTS = [
    "namespace.yaml",
    "serviceaccount.yaml",
    "configmap.yaml",
    "daemonset.yaml",
    "service.yaml",
    "servicemonitor.yaml",
]
POD_RESOURCES = "/var/lib/kubelet/pod-resources"
REQUIRE = os.environ.get("ZEUS_ASYNC_REQUIRE_DEPLOY_TOOLS") == "1"

Obj = dict[str, Any]


def missing(tool: str, how: str) -> None:
    """Skip, naming the tool and how to get it; fail instead where CI installed the tools."""
    if REQUIRE:
        pytest.fail(f"{tool} is not available and ZEUS_ASYNC_REQUIRE_DEPLOY_TOOLS=1 is set")
    pytest.skip(f"{tool} is not available ({how})")


def version() -> str:
    """The package's version (pyproject.toml): the image tag the manifests name."""
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def plain() -> list[Obj]:
    docs: list[Obj] = []
    for name in MANIFESTS:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    return docs


def by_kind(objs: list[Obj]) -> dict[str, Obj]:
    kinds = {o["kind"]: o for o in objs}
    assert len(kinds) == len(objs), "one object of each kind"
    return kinds


# -- the objects fit together -------------------------------------------------------------------


def check_objects(objs: list[Obj], port: int, image: str) -> None:
    """What must hold of the agent's objects, plain or rendered."""
    kinds = by_kind(objs)
    ds, svc, sa, cm = (kinds[k] for k in ("DaemonSet", "Service", "ServiceAccount", "ConfigMap"))
    namespace = ds["metadata"]["namespace"]
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["kind"]
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    [container] = spec["containers"]
    assert container["image"] == image
    # Host pids (NVML names host pids), every GPU, and none taken from the pods.
    assert spec["hostPID"] is True
    assert spec["runtimeClassName"] == "nvidia"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in container["env"]
    for part in ("requests", "limits"):
        assert not any("gpu" in r for r in container["resources"].get(part, {})), part
    # The PodResources directory, read-only, and the socket in it.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[POD_RESOURCES]
    assert mount["readOnly"] is True
    assert volumes[mount["name"]]["hostPath"] == {"path": POD_RESOURCES, "type": "Directory"}
    args = container["args"]

    def arg(flag: str) -> str:
        return str(args[args.index(flag) + 1])

    assert arg("--k8s-socket") == f"{POD_RESOURCES}/kubelet.sock"
    assert "--system" in args
    # Lease journals on the node: a replaced agent restores what its predecessor changed.
    run = volumes[mounts["/run/zeus-async"]["name"]]
    assert run["hostPath"]["path"] == "/run/zeus-async"
    # The policy the agent reads is the ConfigMap's, and parses.
    policy = Path(arg("--policy"))
    policy_volume = volumes[mounts[str(policy.parent)]["name"]]
    assert policy_volume["configMap"]["name"] == cm["metadata"]["name"]
    assert tomllib.loads(cm["data"][policy.name])["control"]["default"] == "none"
    # One metrics port everywhere.
    assert int(arg("--prometheus-port")) == port
    assert arg("--prometheus-addr") == "0.0.0.0"
    [cport] = container["ports"]
    assert (cport["name"], cport["containerPort"]) == ("metrics", port)
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    [sport] = svc["spec"]["ports"]
    assert (sport["port"], sport["targetPort"]) == (port, "metrics")
    assert svc["spec"]["clusterIP"] == "None"
    # Selectors select what they should.
    pod_labels = pod["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    # The agent calls no API: its account has no token (and no RBAC object exists).
    assert spec["serviceAccountName"] == sa["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is False
    assert sa["automountServiceAccountToken"] is False
    assert not {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"} & set(kinds)
    # Restores need root and CAP_SYS_ADMIN; time to finish them on SIGTERM.
    security = container["securityContext"]
    assert security["runAsUser"] == 0 and "SYS_ADMIN" in security["capabilities"]["add"]
    assert spec["terminationGracePeriodSeconds"] >= 60
    if "ServiceMonitor" in kinds:
        sm = kinds["ServiceMonitor"]
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert namespace in sm["spec"]["namespaceSelector"]["matchNames"]
        [endpoint] = sm["spec"]["endpoints"]
        assert endpoint["port"] == sport["name"] and endpoint["path"] == "/metrics"
        # The workloads' namespace/pod/container labels survive the scrape.
        assert endpoint["honorLabels"] is True
        [drop] = [r for r in endpoint["relabelings"] if r.get("action") == "labeldrop"]
        assert set(drop["regex"].strip("()").split("|")) >= {"namespace", "pod", "container"}


def test_plain_manifests_fit_together() -> None:
    objs = plain()
    assert [o["kind"] for o in objs] == [
        "Namespace",
        "ServiceAccount",
        "ConfigMap",
        "DaemonSet",
        "Service",
        "ServiceMonitor",
    ]
    check_objects(objs, port=9466, image=f"zeus-async:{version()}")
    assert by_kind(objs)["Namespace"]["metadata"]["labels"][
        "pod-security.kubernetes.io/enforce"
    ] == ("privileged")


def test_the_checks_catch_a_wrong_port() -> None:
    objs = plain()
    by_kind(objs)["Service"]["spec"]["ports"][0]["port"] = 9467
    with pytest.raises(AssertionError):
        check_objects(objs, port=9466, image=f"zeus-async:{version()}")


# -- kubectl ------------------------------------------------------------------------------------

# What the discovery stub serves: (group version, resource, kind, namespaced).
RESOURCES = [
    ("v1", "namespaces", "Namespace", False),
    ("v1", "serviceaccounts", "ServiceAccount", True),
    ("v1", "configmaps", "ConfigMap", True),
    ("v1", "services", "Service", True),
    ("apps/v1", "daemonsets", "DaemonSet", True),
    ("monitoring.coreos.com/v1", "servicemonitors", "ServiceMonitor", True),
]


class _Discovery(BaseHTTPRequestHandler):
    """The API server's discovery documents (legacy format), and 404 for everything else."""

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        groups = sorted({gv for gv, *_ in RESOURCES if "/" in gv})
        body: Obj | None = None
        if path == "/api":
            body = {"kind": "APIVersions", "versions": ["v1"]}
        elif path == "/apis":
            body = {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": gv.split("/")[0],
                        "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                        "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]},
                    }
                    for gv in groups
                ],
            }
        else:
            gv = path.removeprefix("/api/").removeprefix("/apis/")
            listed = [r for r in RESOURCES if r[0] == gv]
            if listed and path in (f"/api/{gv}", f"/apis/{gv}"):
                body = {
                    "kind": "APIResourceList",
                    "apiVersion": "v1",
                    "groupVersion": gv,
                    "resources": [
                        {"name": name, "singularName": "", "namespaced": ns, "kind": kind}
                        | {"verbs": ["create", "get", "list"]}
                        for _, name, kind, ns in listed
                    ],
                }
        data = json.dumps(body).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data) if body is not None else 0))
        self.end_headers()
        if body is not None:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def kubectl(tmp_path: Path) -> Iterator[list[str]]:
    """``kubectl`` with a discovery stub on 127.0.0.1 as its server, and its own cache."""
    exe = shutil.which("kubectl")
    if exe is None:
        missing("kubectl", "apt-get install kubernetes-client")
    assert exe is not None
    config = tmp_path / "kubeconfig"
    config.write_text("apiVersion: v1\nkind: Config\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Discovery)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield [
            exe,
            f"--server=http://127.0.0.1:{server.server_address[1]}",
            f"--cache-dir={tmp_path / 'cache'}",
            f"--kubeconfig={config}",
            "--request-timeout=20s",
        ]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_kubectl_client_dry_run_takes_every_manifest(kubectl: list[str]) -> None:
    files = [a for name in MANIFESTS for a in ("-f", str(K8S / name))]
    proc = subprocess.run(
        [*kubectl, "create", "--dry-run=client", "--validate=false", "-o", "json", *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # One JSON document per object, in order, as kubectl decoded them.
    decoder, text, objs = json.JSONDecoder(), proc.stdout, list[Obj]()
    while text.strip():
        obj, end = decoder.raw_decode(text.lstrip())
        objs += obj["items"] if obj["kind"] == "List" else [obj]  # older kubectl: one List
        text = text.lstrip()[end:]
    assert objs == plain()


def test_kubectl_dry_run_refuses_an_unknown_kind(kubectl: list[str], tmp_path: Path) -> None:
    bad = (K8S / "daemonset.yaml").read_text().replace("kind: DaemonSet", "kind: DaemonSett")
    bad_file = str(tmp_path / "bad.yaml")
    Path(bad_file).write_text(bad)
    proc = subprocess.run(
        [*kubectl, "create", "--dry-run=client", "--validate=false", "-o", "json", "-f", bad_file],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert 'no matches for kind "DaemonSett" in version "apps/v1"' in proc.stderr


def test_kustomization_builds_the_same_objects() -> None:
    exe = shutil.which("kubectl")
    if exe is None:
        missing("kubectl", "apt-get install kubernetes-client")
    assert exe is not None
    proc = subprocess.run([exe, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    built = list(yaml.safe_load_all(proc.stdout))
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(built, key=key) == sorted(plain(), key=key)


# -- Helm ---------------------------------------------------------------------------------------

_SDK_RENDER = """
import json, sys
import helm_python as helm
chart, values = sys.argv[1], json.loads(sys.argv[2])
with helm.Chart.load(chart) as c:
    out = c.render(values, name="zeus-async", namespace="zeus-async", is_install=True)
print(json.dumps(out))
"""
_SDK_LINT = """
import json, sys
import helm_python as helm
print(json.dumps(helm.lint(sys.argv[1], strict=True)))
"""


def helm_template(values: Obj | None = None, tmp: Path | None = None) -> list[Obj]:
    """The chart's objects for release ``zeus-async`` in namespace ``zeus-async``."""
    helm = shutil.which("helm")
    if helm is not None:
        given: list[str] = []
        if values:
            assert tmp is not None
            (tmp / "values.json").write_text(json.dumps(values))  # JSON is YAML
            given = ["--values", str(tmp / "values.json")]
        proc = subprocess.run(
            [helm, "template", "zeus-async", str(CHART), "--namespace", "zeus-async", *given],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
    if importlib.util.find_spec("helm_python") is not None:
        proc = subprocess.run(
            [sys.executable, "-c", _SDK_RENDER, str(CHART), json.dumps(values or {})],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        rendered: dict[str, str] = json.loads(proc.stdout)
        return [
            d
            for name, text in sorted(rendered.items())
            if name.endswith(".yaml")
            for d in yaml.safe_load_all(text)
            if d is not None
        ]
    missing("helm", "install the helm binary, or pip install helm-python-sdk")
    raise AssertionError  # unreachable


def test_chart_renders_the_plain_manifests() -> None:
    rendered = helm_template()
    for obj in rendered:
        labels = obj["metadata"]["labels"]
        assert labels.pop("app.kubernetes.io/managed-by") == "Helm"
        assert labels.pop("helm.sh/chart") == f"zeus-async-{version()}"
        if obj["kind"] == "DaemonSet":
            annotations = obj["spec"]["template"]["metadata"]["annotations"]
            assert len(annotations.pop("checksum/policy")) == 16
    expected = [o for o in plain() if o["kind"] != "Namespace"]  # helm --create-namespace
    key = lambda o: o["kind"]  # noqa: E731
    assert sorted(rendered, key=key) == sorted(expected, key=key)


def test_chart_versions_are_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version()


def test_chart_follows_its_values(tmp_path: Path) -> None:
    objs = helm_template(
        {
            "image": {"repository": "registry.example.com/zeus-async", "tag": "9.9.9"},
            "metricsPort": 9500,
            "serviceMonitor": {"enabled": False},
            "extraArgs": ["--publish", "tcp://0.0.0.0:5555"],
        },
        tmp_path,
    )
    assert "ServiceMonitor" not in by_kind(objs)
    check_objects(objs, port=9500, image="registry.example.com/zeus-async:9.9.9")
    [container] = by_kind(objs)["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert container["args"][-2:] == ["--publish", "tcp://0.0.0.0:5555"]


def test_chart_without_the_nvidia_runtime_class(tmp_path: Path) -> None:
    objs = helm_template({"runtimeClassName": "", "hostNetwork": False}, tmp_path)
    spec = by_kind(objs)["DaemonSet"]["spec"]["template"]["spec"]
    assert "runtimeClassName" not in spec
    assert (spec["hostNetwork"], spec["dnsPolicy"]) == (False, "ClusterFirst")


def test_helm_lint_passes() -> None:
    helm = shutil.which("helm")
    if helm is not None:
        proc = subprocess.run(
            [helm, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "0 chart(s) failed" in proc.stdout
        return
    if importlib.util.find_spec("helm_python") is None:
        missing("helm", "install the helm binary, or pip install helm-python-sdk")
    proc = subprocess.run(
        [sys.executable, "-c", _SDK_LINT, str(CHART)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["total_charts_linted"] == 1 and report["errors"] == []
    # Severity 1 is information ("icon is recommended"); 2 and 3 are warnings and errors.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_the_policy_is_one_the_agent_loads(tmp_path: Path) -> None:
    from zeus_async.agent.policy import load_policy

    path = tmp_path / "policy.toml"
    path.write_text(by_kind(plain())["ConfigMap"]["data"]["policy.toml"])
    policy = load_policy(path, group="zeus-async")
    assert policy.default == "none" and policy.rules == ()
