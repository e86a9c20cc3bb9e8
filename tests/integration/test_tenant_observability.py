"""Per-tenant alerts and rollout analysis (issue 52 point 5): deploy/prometheus/tenant_alerts.yml passes promtool's
check and its unit tests, reads only series the server exposes with the labels it gives them, and the rendered
preview analysis judges the 5xx share per tenant (evaluated by promtool on series where one tenant's failures are
diluted by another's traffic)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from server.metrics import Metrics

ROOT = Path(__file__).parents[2]
RULES = ROOT / "deploy" / "prometheus"


def _promtool() -> str:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `make tools` installs Debian's prometheus package"
    return promtool


def test_tenant_alert_rules_check_and_unit_tests_pass() -> None:
    check = subprocess.run([_promtool(), "check", "rules", "tenant_alerts.yml"], cwd=RULES, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 2 rules found" in check.stdout, check.stdout + check.stderr
    tests = subprocess.run([_promtool(), "test", "rules", "tenant_alerts_test.yml"], cwd=RULES,
                           capture_output=True, text=True, timeout=60)
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_tenant_alerts_read_series_the_server_exposes() -> None:
    """Every series an alert selects is one server/metrics.py exposes, selected only by labels it carries."""
    m = Metrics()
    m.tenant_requests.labels("team-a", "/v1/images/generations", "200").inc()
    m.tenant_request_seconds.labels("team-a", "/v1/images/generations").observe(1.0)
    m.tenant_refused.labels("team-a", "in_flight").inc()
    m.set_tenant_slos({"team-a": 10.0})
    labels = {s.name: set(s.labels) for f in m.registry.collect() for s in f.samples}
    rules = yaml.safe_load((RULES / "tenant_alerts.yml").read_text())["groups"][0]["rules"]
    selected = [(r["alert"], name, selector) for r in rules
                for name, selector in re.findall(r"(sdserve_\w+)\{([^}]*)\}", r["expr"])]
    assert len(selected) == 6  # the p95 and the SLO gauge twice each (own threshold, or 30 s without one)
    for alert, name, selector in selected:
        assert name in labels, f"{alert}: {name} is not a series of server/metrics.py"
        used = set(re.findall(r"(\w+)\s*(?:=~|!=|=)", selector))
        assert "tenant" in used and used <= labels[name], f"{alert}: {name} has no labels {used - labels[name]}"


def _analysis_query(name: str) -> str:
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "analysis.yaml").read_text()) if d]
    health = next(d for d in docs if d["metadata"]["name"] == "sdserve-preview-health")
    metric: dict[str, Any] = next(m for m in health["spec"]["metrics"] if m["name"] == name)
    return str(metric["provider"]["prometheus"]["query"])


def test_the_preview_error_rate_is_judged_per_tenant(tmp_path: Path) -> None:
    """team-a: 10 of 100 requests a minute fail (10%); team-b: 900 a minute, none fail. The whole preview's share is
    1%, which would pass ``result[0] <= 0.01``; the query reads team-a's 10%, which fails it. With no traffic: 0."""
    query = _analysis_query("error-rate")
    preview = 'service="sdserve-preview"'
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "analysis", "rules": [
        {"record": "sdserve:preview_error_rate", "expr": query}]}]}))
    series = [(f'sdserve_tenant_requests_total{{{preview}, tenant="team-a", route="/v1/images/generations", '
               f'status="200"}}', "0+90x10"),
              (f'sdserve_tenant_requests_total{{{preview}, tenant="team-a", route="/v1/images/generations", '
               f'status="500"}}', "0+10x10"),
              (f'sdserve_tenant_requests_total{{{preview}, tenant="team-b", route="/sdapi/v1/txt2img", '
               f'status="200"}}', "0+900x10")]
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
         "promql_expr_test": [  # per mille: promtool compares floats exactly
             {"expr": "round(1000 * sdserve:preview_error_rate)", "eval_time": "5m",
              "exp_samples": [{"labels": "{}", "value": 100}]},
             {"expr": 'round(1000 * sum(rate(sdserve_tenant_requests_total{status=~"5.."}[1m])) / '
                      'sum(rate(sdserve_tenant_requests_total[1m])))', "eval_time": "5m",
              "exp_samples": [{"labels": "{}", "value": 10}]}]},
        {"interval": "1m", "input_series": [{"series": "sdserve_ready", "values": "1x5"}],
         "promql_expr_test": [{"expr": "sdserve:preview_error_rate", "eval_time": "5m",
                               "exp_samples": [{"labels": "sdserve:preview_error_rate", "value": 0}]}]}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    done = subprocess.run([_promtool(), "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
