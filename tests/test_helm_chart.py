"""The Helm chart lints, renders and validates for every variant, and says what the router needs.

Rendering and linting go through Helm's own Go library (helm-python-sdk: no helm binary, no
cluster, no network); every rendered manifest is checked in strict mode (unknown fields fail)
against the Kubernetes schemas bundled in kubernetes-validate, for the oldest Kubernetes the
chart supports and the newest the validator knows. So a typo in a template, a field that an old
cluster lacks, or a probe that points at the wrong path fails here rather than at
`helm install` or, worse, in a pod that never becomes ready.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from engine_shim.cli import build_parser as shim_parser
from engine_shim.cli import config_from_args as shim_config
from router.config import ConfigError, RouterConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "prefix-router"
EXAMPLES = CHART / "examples"
RELEASE = "demo"
NAMESPACE = "llm"
FULLNAME = f"{RELEASE}-prefix-router"
# The oldest Kubernetes in Chart.yaml's kubeVersion, and the newest the validator ships.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
ROUTER_PORT = 8000
CONFIG_PATH = "/etc/prefix-router/config.yaml"
# What the Secrets behind the router's secretKeyRef variables would hold in a cluster.
SECRET_STANDINS = {
    "PREFIX_ROUTER_ADMIN_TOKEN": "t0ken",
    "PREFIX_ROUTER_INDEX": "redis://:pw@redis-master.data.svc.cluster.local:6379/0",
}

# The Prometheus Operator's ServiceMonitor is a CRD, outside the Kubernetes schemas: check the
# fields the chart writes against the operator's documented shape.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "namespaceSelector": {
                    "type": "object",
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "selector": {"type": "object", "required": ["matchLabels"]},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


# Every variant an operator is expected to install; each must lint, render and validate.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "trial-fleet-bundled-redis": example("trial.yaml"),
    "vllm-headless-discovery": example("vllm-discovery.yaml"),
    "vllm-static": example("vllm-static.yaml"),
    "ha-3-replicas-hpa-pdb": example("ha.yaml"),
    "everything-on": {
        **example("vllm-static.yaml"),
        "trialFleet": {"enabled": True, "replicas": 2},
        "redis": {"enabled": True},
        "engines": {
            **example("vllm-static.yaml")["engines"],
            "discovery": {"enabled": True, "service": "vllm", "namespace": "gpu"},
        },
        "ingress": {"enabled": True, "className": "nginx", "tls": [{"hosts": ["r.example"]}]},
        "metrics": {"podAnnotations": True, "serviceMonitor": {"enabled": True}},
        "podDisruptionBudget": {"enabled": True},
        "autoscaling": {"enabled": True, "targetMemoryUtilizationPercentage": 80},
        "podAntiAffinity": "hard",
        "router": {
            "tokenizer": "/models/tokenizer",
            "extraArgs": ["--log-level", "debug"],
            "extraEnv": [{"name": "FOO", "value": "bar"}],
            "extraVolumes": [{"name": "tok", "persistentVolumeClaim": {"claimName": "tok"}}],
            "extraVolumeMounts": [{"name": "tok", "mountPath": "/models", "readOnly": True}],
            "config": {"load_weight": 0.5, "log_format": "text"},
        },
        "adminToken": {"existingSecret": "ops-router-admin", "secretKey": "token"},
        "service": {"type": "LoadBalancer"},
    },
}


# --- helpers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render_files(chart: helm.Chart, values: dict[str, Any] | None = None) -> dict[str, str]:
    return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path, text in sorted(render_files(chart, values).items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def notes(chart: helm.Chart, values: dict[str, Any] | None = None) -> str:
    return render_files(chart, values)[f"{CHART.name}/templates/NOTES.txt"]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def router_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", FULLNAME)


def router_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = router_deployment(docs)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "router")


def router_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(one(docs, "ConfigMap", FULLNAME)["data"]["config.yaml"])


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "Pod":
            out.append((d["metadata"]["name"], d["spec"]))
    return out


def leaf_paths(values: Any, prefix: str = "") -> list[str]:
    if isinstance(values, dict) and values:
        paths = []
        for key, value in values.items():
            paths.extend(leaf_paths(value, f"{prefix}.{key}" if prefix else key))
        return paths
    return [prefix]


# --- every variant: lint, render, validate -------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint_is_clean(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_validates_against_kubernetes_schemas(chart, variant: str) -> None:
    docs = render(chart, VARIANTS[variant])
    assert docs
    for doc in docs:
        assert doc["metadata"].get("namespace") == NAMESPACE or doc["kind"] == "ServiceMonitor"
        if doc["kind"] == "ServiceMonitor":
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {where}: {e}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_pod_runs_non_root_with_a_read_only_root(chart, variant: str) -> None:
    for name, pod in pod_specs(render(chart, VARIANTS[variant])):
        assert pod.get("automountServiceAccountToken") is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] > 0, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert c["resources"]["limits"]["memory"], (name, c["name"])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_selectors_pick_exactly_their_own_pods(chart, variant: str) -> None:
    docs = render(chart, VARIANTS[variant])
    workloads = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            selector = d["spec"]["selector"]["matchLabels"]
            assert selector.items() <= workloads[d["metadata"]["name"]].items()
        if d["kind"] == "Service":
            picked = [
                n
                for n, labels in workloads.items()
                if d["spec"]["selector"].items() <= labels.items()
            ]
            assert len(picked) == 1, (d["metadata"]["name"], picked)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for d in docs:
        selector = d.get("spec", {}).get("selector", {}).get("matchLabels")
        if d["kind"] == "PodDisruptionBudget":
            assert selector.items() <= workloads[FULLNAME].items()
        if d["kind"] == "ServiceMonitor":
            assert selector.items() <= services[FULLNAME]["metadata"]["labels"].items()
            others = [n for n in services if n != FULLNAME]
            assert not [
                n for n in others if selector.items() <= services[n]["metadata"]["labels"].items()
            ]


# --- the router's contract: ports, probes, args, config ------------------------------------


def test_probes_and_ports_match_the_router(chart) -> None:
    docs = render(chart)
    c = router_container(docs)
    assert c["ports"] == [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    svc = one(docs, "Service", FULLNAME)
    assert svc["spec"]["ports"][0]["port"] == ROUTER_PORT
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert c["args"][:4] == ["prefix-router", "serve", "--config", "/etc/prefix-router/config.yaml"]
    config = router_config(docs)
    assert config["host"] == "0.0.0.0" and config["port"] == ROUTER_PORT
    assert config["index"] == "memory" and config["hash_scheme"] == "auto"
    assert config["block_size"] == 16


def test_graceful_shutdown_and_spreading(chart) -> None:
    docs = render(chart, {"terminationGracePeriodSeconds": 300, "preStopSleepSeconds": 7})
    pod = router_deployment(docs)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 300
    assert router_container(docs)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    soft = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert soft[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    strategy = router_deployment(docs)["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0
    hard = render(chart, {"podAntiAffinity": "hard"})
    spec = router_deployment(hard)["spec"]["template"]["spec"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in spec["affinity"]["podAntiAffinity"]
    assert (
        "affinity"
        not in router_deployment(render(chart, {"podAntiAffinity": "none"}))["spec"]["template"][
            "spec"
        ]
    )


def router_settings(docs: list[dict[str, Any]], tmp_path: Path) -> RouterConfig:
    """What the router would run with: its real config loader on the rendered args, file, env."""
    c = router_container(docs)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(one(docs, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    assert c["args"][:2] == ["prefix-router", "serve"]
    argv = [str(config_file) if a == CONFIG_PATH else a for a in c["args"][2:]]
    env = {e["name"]: e.get("value", SECRET_STANDINS.get(e["name"])) for e in c["env"]}
    return load_config(argv, env)


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"default"}))
def test_the_router_accepts_the_rendered_settings(chart, variant: str, tmp_path: Path) -> None:
    docs = render(chart, VARIANTS[variant])
    cfg = router_settings(docs, tmp_path)
    c = router_container(docs)
    assert cfg.port == c["ports"][0]["containerPort"] and cfg.host == "0.0.0.0"
    assert [e.url for e in cfg.engines] == [
        s.split(",")[0] for s in flag_values(c["args"], "--engine")
    ]
    assert cfg.discovery == next(iter(flag_values(c["args"], "--discovery")), None)
    assert cfg.admin_token == SECRET_STANDINS["PREFIX_ROUTER_ADMIN_TOKEN"] or (
        VARIANTS[variant].get("adminToken", {}).get("existingSecret")
    )
    uses_redis = VARIANTS[variant].get("redis", {}).get("enabled") or (
        VARIANTS[variant].get("index", {}).get("type") == "redis"
    )
    assert cfg.index.startswith("redis://") if uses_redis else cfg.index == "memory"


def test_the_router_refuses_to_start_without_engines(chart, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no engines"):
        router_settings(render(chart), tmp_path)


def test_config_change_rolls_the_pods(chart) -> None:
    def checksum(values: dict[str, Any]) -> str:
        pod = router_deployment(render(chart, values))["spec"]["template"]
        return pod["metadata"]["annotations"]["checksum/config"]

    assert checksum({}) == checksum({})
    assert checksum({}) != checksum({"router": {"logLevel": "debug"}})


def test_static_engines_all_reach_the_router_args(chart) -> None:
    values = example("vllm-static.yaml")
    docs = render(chart, values)
    engines = flag_values(router_container(docs)["args"], "--engine")
    expected = []
    for e in values["engines"]["static"]:
        spec = f"{e['url']},events={e['events']},replay={e['replay']}"
        expected.append(spec + (f",dp={e['dp']}" if "dp" in e else ""))
    assert engines == expected
    assert flag_values(router_container(docs)["args"], "--discovery") == []
    config = router_config(docs)
    assert config["hash_scheme"] == "sha256_cbor" and config["hash_seed"] == "0"
    assert config["model"] == values["router"]["model"] and config["tokenizer"] == "engine"
    assert "engines" not in config, "engines belong in args only (no duplicates)"


def test_an_engine_without_event_sockets_is_passed_as_a_bare_url(chart) -> None:
    docs = render(chart, {"engines": {"static": [{"url": "http://10.0.0.5:8000"}]}})
    assert flag_values(router_container(docs)["args"], "--engine") == ["http://10.0.0.5:8000"]


def test_headless_service_discovery(chart) -> None:
    docs = render(chart, example("vllm-discovery.yaml"))
    args = router_container(docs)["args"]
    assert flag_values(args, "--discovery") == [
        f"dns://vllm.{NAMESPACE}.svc.cluster.local:8000?events=5557&replay=5558"
    ]
    assert flag_values(args, "--discovery-interval-s") == ["10"]
    assert flag_values(args, "--engine") == []
    other = render(
        chart,
        {
            "clusterDomain": "corp.internal",
            "engines": {
                "discovery": {
                    "enabled": True,
                    "service": "gpu",
                    "namespace": "inf",
                    "dp": 2,
                }
            },
        },
    )
    assert flag_values(router_container(other)["args"], "--discovery") == [
        "dns://gpu.inf.svc.corp.internal:8000?events=5557&replay=5558&dp=2"
    ]


def test_trial_fleet_with_bundled_redis(chart, tmp_path: Path, monkeypatch) -> None:
    values = example("trial.yaml")
    docs = render(chart, values)
    replicas = values["trialFleet"]["replicas"]
    engine = f"{FULLNAME}-engine"
    sts = one(docs, "StatefulSet", engine)
    headless = one(docs, "Service", engine)
    assert sts["spec"]["serviceName"] == engine and sts["spec"]["replicas"] == replicas
    assert headless["spec"]["clusterIP"] == "None"

    shim = sts["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in shim["ports"]}
    assert shim["args"][0] == "engine-shim"
    kv = json.loads(flag_values(shim["args"], "--kv-events-config")[0])
    assert kv == {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{ports['kv-events']}",
        "replay_endpoint": f"tcp://*:{ports['kv-replay']}",
    }
    assert flag_values(shim["args"], "--port") == [str(ports["http"])]
    assert shim["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}

    # The router knows every shim by its stable name, with both event sockets.
    engines = flag_values(router_container(docs)["args"], "--engine")
    assert len(engines) == replicas
    for i, spec in enumerate(engines):
        host = f"{engine}-{i}.{engine}.{NAMESPACE}.svc.cluster.local"
        assert spec == (
            f"http://{host}:{ports['http']},events=tcp://{host}:{ports['kv-events']},"
            f"replay=tcp://{host}:{ports['kv-replay']}"
        )

    # Hash parity: the shims' seed, algorithm, block size and model are the router's, as the
    # two real command lines read them.
    config = router_config(docs)
    seed = env_of(shim)["PYTHONHASHSEED"]["value"]
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    shim_cfg = shim_config(shim_parser().parse_args(shim["args"][1:]))
    router_cfg = router_settings(docs, tmp_path)
    assert shim_cfg.host == "0.0.0.0" and shim_cfg.port == ports["http"]
    assert shim_cfg.kv_events.enable_kv_cache_events is True
    assert shim_cfg.kv_events.endpoint == f"tcp://*:{ports['kv-events']}"
    assert shim_cfg.kv_events.replay_endpoint == f"tcp://*:{ports['kv-replay']}"
    assert shim_cfg.engine.hash_seed == router_cfg.hash_seed == seed
    assert shim_cfg.engine.block_size == router_cfg.block_size
    assert shim_cfg.engine.hash_algo == "sha256_cbor"
    assert shim_cfg.served_model_name == router_cfg.model
    assert router_cfg.index == config["index"]
    assert config["hash_seed"] == seed and "hash_seeds" not in config
    assert flag_values(shim["args"], "--block-size") == [str(config["block_size"])]
    assert flag_values(shim["args"], "--prefix-caching-hash-algo") == ["sha256_cbor"]
    assert flag_values(shim["args"], "--served-model-name") == [config["model"]]

    # Bundled Redis: the router's index points at its Service.
    redis_svc = one(docs, "Service", f"{FULLNAME}-redis")
    redis_port = redis_svc["spec"]["ports"][0]["port"]
    assert config["index"] == (
        f"redis://{FULLNAME}-redis.{NAMESPACE}.svc.cluster.local:{redis_port}/0"
    )
    redis = one(docs, "Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]
    assert redis["containers"][0]["args"][0] == "redis-server"
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_three_replicas_with_hpa_pdb_and_service_monitor(chart) -> None:
    values = example("ha.yaml")
    docs = render(chart, values)
    assert values["replicaCount"] == 3
    assert "replicas" not in router_deployment(docs)["spec"], "the HPA owns the replica count"
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 60
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {
        "minAvailable": 2,
        "selector": router_deployment(docs)["spec"]["selector"],
    }
    sm = one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["port"] == "http"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    svc_labels = one(docs, "Service", FULLNAME)["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc_labels.items()
    # The Redis URL (with its password) comes from a Secret, never from the ConfigMap.
    index = env_of(router_container(docs))["PREFIX_ROUTER_INDEX"]["valueFrom"]["secretKeyRef"]
    assert index == {"name": "prefix-router-redis", "key": "redis-url"}
    assert "index" not in router_config(docs)
    assert "redis" not in " ".join(kinds(docs)).lower()
    # Without the HPA, three fixed replicas.
    fixed = render(chart, {**values, "autoscaling": {"enabled": False}})
    assert router_deployment(fixed)["spec"]["replicas"] == 3
    assert not [d for d in fixed if d["kind"] == "HorizontalPodAutoscaler"]


def test_optional_objects_are_off_by_default(chart) -> None:
    assert kinds(render(chart)) == [
        "ConfigMap",
        "Deployment",
        "Pod",
        "Secret",
        "Service",
        "ServiceAccount",
    ]


# --- secrets -------------------------------------------------------------------------------


def test_admin_token_comes_from_a_secret(chart) -> None:
    docs = render(chart, {"adminToken": {"value": "s3cret-token"}})
    c = router_container(docs)
    ref = env_of(c)["PREFIX_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = one(docs, "Secret", ref["name"])
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == "s3cret-token"
    rendered = json.dumps([c["args"], router_config(docs), c["env"]])
    assert "s3cret-token" not in rendered and "--admin-token" not in rendered


def test_generated_admin_token_is_long_and_random(chart) -> None:
    tokens = set()
    for _ in range(2):
        secret = one(render(chart), "Secret", f"{FULLNAME}-admin")
        tokens.add(base64.b64decode(secret["data"]["admin-token"]).decode())
    assert len(tokens) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{40}", t) for t in tokens)


def test_existing_secret_and_disabled_token(chart) -> None:
    docs = render(chart, {"adminToken": {"existingSecret": "ops", "secretKey": "tok"}})
    assert not [d for d in docs if d["kind"] == "Secret"]
    ref = env_of(router_container(docs))["PREFIX_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "ops", "key": "tok"}
    off = render(chart, {"adminToken": {"enabled": False}})
    assert not [d for d in off if d["kind"] == "Secret"]
    assert "PREFIX_ROUTER_ADMIN_TOKEN" not in env_of(router_container(off))


# --- the schema and the template guards ----------------------------------------------------

BAD_VALUES = {
    "replicaCount as a word": {"replicaCount": "three"},
    "unknown top-level key": {"replicaCont": 3},
    "unknown nested key": {"router": {"blocksize": 32}},
    "unknown hash scheme": {"router": {"hashScheme": "md5"}},
    "static engine without url": {"engines": {"static": [{"events": "tcp://e:5557"}]}},
    "events endpoint not tcp": {"engines": {"static": [{"url": "http://e:8000", "events": "e:1"}]}},
    "port out of range": {"engines": {"discovery": {"httpPort": 70000}}},
    "unknown index type": {"index": {"type": "etcd"}},
    "bad pull policy": {"image": {"pullPolicy": "Sometimes"}},
    "negative grace period": {"terminationGracePeriodSeconds": -1},
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_schema_rejects_bad_values(chart, case: str) -> None:
    bad = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(chart.merge_values(bad))
    with pytest.raises(helm.HelmValuesError):
        render_files(chart, bad)
    report = helm.lint(CHART, bad, namespace=NAMESPACE)
    assert report["errors"], case


def test_schema_accepts_the_defaults_and_every_variant(chart) -> None:
    for values in VARIANTS.values():
        chart.validate_schema(chart.merge_values(values))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"index": {"type": "redis"}}, "index.type=redis needs"),
        ({"engines": {"discovery": {"enabled": True}}}, "engines.discovery.service"),
    ],
)
def test_incomplete_settings_fail_with_a_clear_message(chart, values, message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render_files(chart, values)


# --- what the operator reads ---------------------------------------------------------------


def test_notes_say_how_to_reach_the_router_and_its_metrics(chart) -> None:
    text = notes(chart, example("trial.yaml"))
    assert f"port-forward svc/{FULLNAME} 8000:8000" in text
    assert "/v1/chat/completions" in text and "/metrics" in text
    assert f"{FULLNAME}-engine-2.{FULLNAME}-engine" in text
    assert '"model": "SmolLM2-135M-Instruct"' in text
    assert "WARNING" not in text
    bare = notes(chart)
    assert "WARNING: no engine is configured" in bare
    many = notes(chart, {"replicaCount": 3})
    assert "in-memory index" in many
    assert "in-memory index" not in notes(chart, {"replicaCount": 3, "redis": {"enabled": True}})


# Values documented as one Kubernetes-shaped block rather than leaf by leaf.
DOCUMENTED_AS_A_BLOCK = (
    "resources",
    "podSecurityContext",
    "securityContext",
    "redis.resources",
    "trialFleet.resources",
)


def test_readme_documents_every_value() -> None:
    readme = (CHART / "README.md").read_text()
    rows = set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", readme, re.M))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [
        p
        for p in leaf_paths(values)
        if p not in rows and not any(p.startswith(b + ".") for b in DOCUMENTED_AS_A_BLOCK)
    ]
    assert not missing, f"values missing from helm/prefix-router/README.md: {missing}"
    unknown = rows - set(leaf_paths(values)) - set(DOCUMENTED_AS_A_BLOCK)
    assert not unknown, f"README documents values that do not exist: {unknown}"


def test_vllm_fleet_example_has_every_flag_the_router_needs() -> None:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "vllm-fleet.yaml").read_text()) if d]
    for doc in docs:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    sts = one(docs, "StatefulSet")
    svc = one(docs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    vllm = sts["spec"]["template"]["spec"]["containers"][0]
    args = vllm["args"]
    assert "--enable-prefix-caching" in args
    assert flag_values(args, "--prefix-caching-hash-algo") == ["sha256_cbor"]
    assert flag_values(args, "--block-size") == ["16"]
    kv = json.loads(flag_values(args, "--kv-events-config")[0])
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    assert kv["endpoint"] == f"tcp://*:{ports['kv-events']}"
    assert kv["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
    # The router's values for this fleet agree with it.
    seed = env_of(vllm)["PYTHONHASHSEED"]["value"]
    discovery = example("vllm-discovery.yaml")
    assert discovery["router"]["hashSeeds"] == [seed]
    assert discovery["engines"]["discovery"]["service"] == svc["metadata"]["name"]
    d = discovery["engines"]["discovery"]
    assert (d["httpPort"], d["eventsPort"], d["replayPort"]) == (
        ports["http"],
        ports["kv-events"],
        ports["kv-replay"],
    )
    assert example("vllm-static.yaml")["router"]["hashSeeds"] == [seed]


# --- the image the chart runs ---------------------------------------------------------------


def test_image_matches_the_chart() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert chart_meta["appVersion"] == re.search(r'^version = "([^"]+)"', pyproject, re.M)[1]
    for script in ("prefix-router", "engine-shim", "kv-events"):
        assert re.search(rf"^{script} = ", pyproject, re.M), script
    assert "USER ${UID}:${UID}" in dockerfile
    uid = int(re.search(r"^ARG UID=(\d+)$", dockerfile, re.M)[1])
    assert uid == values["podSecurityContext"]["runAsUser"]
    assert re.search(r"^FROM .* AS runtime$", dockerfile, re.M)
    runtime = dockerfile.split(" AS runtime", 1)[1]
    assert "torch" not in runtime, "the runtime stage must stay torch-free"
    assert "PREFIX_ROUTER_CACHE=/opt/prefix-router/cache" in runtime
    assert 'ENTRYPOINT ["/usr/bin/tini", "--"]' in runtime
    assert f'"--port", "{values["router"]["port"]}"' in runtime
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignored[0] == "*" and {"!events/", "!router/", "!engine_shim/"} <= set(ignored)
