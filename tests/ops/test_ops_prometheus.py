"""deploy/prometheus and the monitoring pieces of deploy/ against promtool and a real Prometheus.

Fast (promtool only): the shipped rules pass `promtool check rules` and their unit tests
(`deploy/prometheus/xlaserve-rules.test.yaml`, `promtool test rules`), and every metric they
read is one the server exports.

Slow: a real `xlaserve serve` (the default model, the shared test engine config: 8 sequences,
96 KV pages of 16 tokens, at most 16 requests queued) scraped every second by a real
Prometheus (Debian's `prometheus` package) evaluating a test copy of the rules every second,
the copy differing only in short `for:` and range windows and the thresholds in
`TEST_THRESHOLDS`. Under a load of long prompts arriving faster than the server finishes
them (the queue grows, KV pages run out, requests past the queue limit are refused with
429), every alert fires; every Grafana panel expression and every prometheus-adapter query
(parsed from the shipped files) and every metric docs/api.md tells the inference extension
to read returns a series.

Without the prometheus package (prometheus and promtool on PATH; `.ci/system_deps` installs it) the
tests skip and say so.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import yaml
from ops_procs import OpsServer
from server_procs import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(REPO, "deploy")
RULES = os.path.join(DEPLOY, "prometheus", "xlaserve-rules.yaml")
RULES_TEST = os.path.join(DEPLOY, "prometheus", "xlaserve-rules.test.yaml")
DASHBOARD = os.path.join(DEPLOY, "grafana", "xlaserve-dashboard.json")
K8S = os.path.join(DEPLOY, "k8s")
API_DOC = os.path.join(REPO, "docs", "api.md")

# The test copy of the rules: every `for:` and range window shortened, and these thresholds
# (alert -> (shipped, test)) lowered where the test's load cannot be relied on to cross the
# shipped one on every machine (a fast one can serve a first token in under 2 s even behind
# a full queue).
TEST_FOR, TEST_WINDOW = "2s", "15s"
TEST_THRESHOLDS = {"XlaserveTTFTAboveSLO": ("> 2", "> 0.25")}
# Target labels as Kubernetes service discovery would attach them (the adapter rules key
# their per-pod series on namespace and pod).
TARGET_LABELS = {"namespace": "default", "pod": "xlaserve-0"}
GRAFANA_VARS = {"$model": ".*", "$role": ".*", "$replica": ".*", "$__rate_interval": "20s"}
MAX_QUEUED = 16


def require_tool(name: str) -> str:
  """The tool's path, or a skip naming the package that provides it."""
  path = shutil.which(name)
  if path is None:
    pytest.skip(f"{name} is not installed (Debian's `prometheus` package; .ci/system_deps "
                f"installs it with apt-get where it can)")
  return path


def load_rules() -> dict:
  with open(RULES, encoding="utf-8") as f:
    return yaml.safe_load(f)


def alert_rules(groups: dict) -> list[dict]:
  return [r for g in groups["groups"] for r in g["rules"] if "alert" in r]


def test_rules_pass_promtool_check():
  promtool = require_tool("promtool")
  out = subprocess.run([promtool, "check", "rules", RULES], capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "SUCCESS: 4 rules found" in out.stdout


def test_rules_unit_tests_pass():
  """Each alert fires on a series over its threshold for its whole `for:`, not on one that
  is under it or over it for less (the cases in xlaserve-rules.test.yaml)."""
  promtool = require_tool("promtool")
  out = subprocess.run([promtool, "test", "rules", os.path.basename(RULES_TEST)],
                       capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(RULES_TEST))
  assert out.returncode == 0, out.stdout + out.stderr


def test_rules_and_docs_name_exported_metrics():
  """Every metric an alert reads, and every one docs/api.md has the inference extension
  read, is on /metrics (rendered from stats like a server's)."""
  from prometheus_client.parser import text_string_to_metric_families

  from serving.entrypoints.metrics import Metrics
  from serving.types import EngineStats

  stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_pages_total=8,
                      num_pages_free=8, num_preemptions_total=0, prompt_tokens_total=0,
                      generation_tokens_total=0, prefix_cache_queries_total=0,
                      prefix_cache_hits_total=0, prefill_tokens_computed_total=0)
  text = Metrics(lambda: stats, model_name="m").render()[0].decode()
  exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
  read = {m for r in alert_rules(load_rules()) for m in re.findall(r"xlaserve_\w+", r["expr"])}
  assert len(read) == 5 and read <= exported, read - exported
  assert set(endpoint_picker_metrics().values()) <= exported


def rules_test_copy(tmp_path) -> str:
  """The shipped rules with the test's `for:`, range windows and thresholds, written under
  `tmp_path`; every threshold override must apply exactly once."""
  groups = load_rules()
  for rule in alert_rules(groups):
    rule["for"] = TEST_FOR
    expr = rule["expr"].replace("[5m]", f"[{TEST_WINDOW}]")
    if rule["alert"] in TEST_THRESHOLDS:
      shipped, test = TEST_THRESHOLDS[rule["alert"]]
      assert expr.count(shipped) == 1, (rule["alert"], expr)
      expr = expr.replace(shipped, test)
    rule["expr"] = expr
  path = tmp_path / "rules.yaml"
  path.write_text(yaml.safe_dump(groups), encoding="utf-8")
  return str(path)


class Prometheus:
  """A real Prometheus in `workdir`: scrapes `target` (with TARGET_LABELS) and evaluates
  `rules` every second; `query()` / `series()` / `alerts()` use its HTTP API."""

  def __init__(self, workdir, target: str, rules: str):
    binary = require_tool("prometheus")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [rules],
              "scrape_configs": [{"job_name": "xlaserve", "static_configs": [
                  {"targets": [target], "labels": TARGET_LABELS}]}]}
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    self.url = f"http://127.0.0.1:{free_port()}"
    self.log = open(workdir / "prometheus.log", "w+", encoding="utf-8")  # noqa: SIM115
    self.proc = subprocess.Popen(
        [binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address={self.url.removeprefix('http://')}"],
        stdout=self.log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not self._ready():
      if self.proc.poll() is not None or time.monotonic() > deadline:
        self.stop()
        pytest.fail(f"prometheus did not start:\n{self.output()}")
      time.sleep(0.2)

  def _ready(self) -> bool:
    try:
      return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
      return False

  def _get(self, path: str, **params) -> list | dict:
    r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (path, params, body)
    return body["data"]

  def query(self, expr: str) -> list[dict]:
    """An instant vector query's series ([{metric, value}])."""
    data = self._get("query", query=expr)
    assert data["resultType"] == "vector", (expr, data)
    return data["result"]

  def series(self, selector: str) -> list[dict]:
    return self._get("series", **{"match[]": selector})

  def alerts(self) -> dict[str, str]:
    """Alert name -> state ("pending" / "firing") of the active alerts."""
    return {a["labels"]["alertname"]: a["state"] for a in self._get("alerts")["alerts"]}

  def output(self) -> str:
    self.log.flush()
    self.log.seek(0)
    return self.log.read()[-4000:]

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait(10)
    self.log.close()


class Load:
  """Completions of long, distinct prompts arriving every `every_s` on a background event
  loop until `stop()`, which cancels those in flight (the server aborts them); counts the
  HTTP status codes of the finished ones."""

  def __init__(self, base_url: str, every_s: float, max_tokens: int = 60):
    self.base_url, self.every_s, self.max_tokens = base_url, every_s, max_tokens
    self.codes: dict[int, int] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
    self._thread.start()

  def prompt(self, i: int) -> str:
    # About 170 tokens: with 60 generated, 15 of a sequence's 16 pages; a distinct first
    # word, so that no two requests share prefix-cache pages.
    return f"Request {i}. " + "the quick brown fox jumps over the lazy dog " * 18

  async def _one(self, client: httpx.AsyncClient, i: int) -> None:
    r = await client.post("/v1/completions", json={
        "model": "m", "prompt": self.prompt(i), "max_tokens": self.max_tokens,
        "temperature": 0.0, "ignore_eos": True})
    self.codes[r.status_code] = self.codes.get(r.status_code, 0) + 1

  async def _run(self) -> None:
    tasks = []
    async with httpx.AsyncClient(base_url=self.base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=None)) as client:
      i = 0
      while not self._stop.is_set():
        tasks.append(asyncio.create_task(self._one(client, i)))
        i += 1
        await asyncio.sleep(self.every_s)
      for t in tasks:
        t.cancel()
      await asyncio.gather(*tasks, return_exceptions=True)

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(60)


def grafana_exprs() -> list[tuple[str, str]]:
  """(panel title, PromQL) of every panel target, dashboard variables filled in with their
  "All" values and `$__rate_interval` with 20 s."""
  with open(DASHBOARD, encoding="utf-8") as f:
    dash = json.load(f)
  out = []
  for panel in dash["panels"]:
    for target in panel["targets"]:
      expr = target["expr"]
      for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
      assert "$" not in expr, (panel["title"], expr)
      out.append((panel["title"], expr))
  return out


def adapter_queries() -> list[tuple[str, str, str]]:
  """(exposed metric name, series query, metrics query for the pod in TARGET_LABELS) of each
  prometheus-adapter rule, as the adapter renders its templates; checks that every metric
  the HPA reads is one of them."""
  docs = {}
  for name in ("hpa.yaml", "prometheus-adapter-rules.yaml"):
    with open(os.path.join(K8S, name), encoding="utf-8") as f:
      docs[name] = yaml.safe_load(f)
  rules = yaml.safe_load(docs["prometheus-adapter-rules.yaml"]["data"]["config.yaml"])["rules"]
  matchers = ",".join(f'{k}="{v}"' for k, v in TARGET_LABELS.items())
  out = []
  for rule in rules:
    name = rule["name"]["matches"]
    assert re.fullmatch(r"xlaserve_\w+", name), name  # a plain metric name, no capture groups
    query = (rule["metricsQuery"].replace("<<.Series>>", name)
             .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod"))
    assert "<<" not in query, query
    out.append((name, rule["seriesQuery"], query))
  hpa_metrics = {m["pods"]["metric"]["name"] for m in docs["hpa.yaml"]["spec"]["metrics"]
                 if m["type"] == "Pods"}
  assert hpa_metrics and hpa_metrics <= {name for name, _, _ in out}, hpa_metrics
  return out


def endpoint_picker_metrics() -> dict[str, str]:
  """EPP flag -> metric name, as docs/api.md tells users to configure the inference
  extension's endpoint picker."""
  with open(API_DOC, encoding="utf-8") as f:
    flags = dict(re.findall(r"^--([a-z-]+-metric)=(xlaserve_\w+)$", f.read(), re.MULTILINE))
  assert len(flags) == 5, flags
  return flags


def finite(result: list[dict]) -> bool:
  return any(math.isfinite(float(r["value"][1])) for r in result)


@pytest.mark.slow  # a default-model server, Prometheus, about two minutes of load
def test_real_prometheus_scrapes_queries_and_alerts(tmp_path):
  promtool = require_tool("promtool")
  require_tool("prometheus")
  rules = rules_test_copy(tmp_path)
  for path in (RULES, rules):
    out = subprocess.run([promtool, "check", "rules", path], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
  names = {r["alert"] for r in alert_rules(load_rules())}
  # The host tier on (a small one), so the dashboard's tiered-prefix-cache panels have
  # their series.
  server = OpsServer("--served_model_name=m", f"--max_queued_requests={MAX_QUEUED}",
                     "--kv_offload_host_gb=0.05")
  prom = load = None
  try:
    prom = Prometheus(tmp_path, f"127.0.0.1:{server.http_port}", rules)
    load = Load(server.http, every_s=0.05)
    # Each alert must fire at some point (the queue alert may resolve again once the queue
    # stops growing at its limit).
    deadline, fired = time.monotonic() + 240, set()
    while fired != names and time.monotonic() < deadline:
      fired |= {n for n, state in prom.alerts().items() if state == "firing"}
      time.sleep(1)
    assert fired == names, (
        f"fired {sorted(fired)}, want {sorted(names)}; requests {load.codes}\n{prom.output()}")
    assert load.codes.get(429, 0) > 0, load.codes  # past the queue limit
    # Every dashboard panel and every adapter query has data while the load runs.
    for title, expr in grafana_exprs():
      result = prom.query(expr)
      assert result and finite(result), (title, expr, result)
    # The names the inference extension is told to read (docs/api.md) are scraped, LoRA
    # state in vLLM's labels.
    for flag, name in endpoint_picker_metrics().items():
      result = prom.query(name)
      assert len(result) == 1 and finite(result), (flag, name, result)
      if flag == "lora-info-metric":
        # LoRA off: no slots; the adapter lists are empty (Prometheus drops empty labels).
        assert result[0]["metric"]["max_lora"] == "0", result
        assert float(result[0]["value"][1]) > time.time() - 600  # the time it was read
    for name, series_query, metrics_query in adapter_queries():
      assert prom.series(series_query), series_query
      result = prom.query(metrics_query)
      assert [r["metric"].get("pod") for r in result] == [TARGET_LABELS["pod"]], (name, result)
      assert finite(result), (name, result)
  finally:
    if load is not None:
      load.stop()
    if prom is not None:
      prom.stop()
    assert server.terminate() == 0, server.output()
