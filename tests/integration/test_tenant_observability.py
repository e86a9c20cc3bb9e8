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


def _p95_series(preview: str, tenant: str, upper: float) -> list[tuple[str, str]]:
    """10 requests a minute, every one in the latency bucket ending at ``upper`` (p95: 95% into that bucket)."""
    series = f'sdserve_tenant_request_duration_seconds_bucket{{{preview}, tenant="{tenant}", route="/sdapi/v1/txt2img"'
    return [(f'{series}, le="{le}"}}', "0x10" if le != "+Inf" and float(le) < upper else "0+10x10")
            for le in ("10", "20", "30", "60", "+Inf")]


def test_the_preview_p95_is_judged_per_tenant_against_its_own_slo(tmp_path: Path) -> None:
    """p95 19.5 s: team-a (slo.p95_s 10, one pod says 25 mid-reload: the strictest counts) is at 1.95x its SLO,
    team-b (no gauge: 30 s) at 0.65x; p95 58.5 s: team-c (slo 60 s) at 0.975x. The worst ratio, 1.95, fails
    ``result[0] <= 1``; without team-a, 0.975 passes although team-c is over the default 30 s. A tenant with no
    request in the window (NaN p95) and an idle preview read 0."""
    from server.cli.rollout import CONDITIONS, TENANT_P95_QUERY

    assert _analysis_query("tenant-p95") == TENANT_P95_QUERY and CONDITIONS["tenant_p95"] == "result[0] <= 1"
    preview = 'service="sdserve-preview"'
    gauges = [(f'sdserve_tenant_slo_p95_seconds{{{preview}, pod="p1", tenant="team-a"}}', "10x10"),
              (f'sdserve_tenant_slo_p95_seconds{{{preview}, pod="p2", tenant="team-a"}}', "25x10"),
              (f'sdserve_tenant_slo_p95_seconds{{{preview}, pod="p1", tenant="team-c"}}', "60x10")]
    team_b_c = _p95_series(preview, "team-b", 20) + _p95_series(preview, "team-c", 60)
    idle = [(s, "0x10") for s, _ in _p95_series(preview, "team-d", 20)]  # counters that stopped moving
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "analysis", "rules": [
        {"record": "sdserve:preview_tenant_p95_ratio", "expr": TENANT_P95_QUERY}]}]}))

    def case(series: list[tuple[str, str]], per_mille: int) -> dict[str, Any]:
        return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                "promql_expr_test": [{"expr": "round(1000 * sdserve:preview_tenant_p95_ratio)", "eval_time": "5m",
                                      "exp_samples": [{"labels": "{}", "value": per_mille}]}]}

    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [
        case(gauges + _p95_series(preview, "team-a", 20) + team_b_c + idle, 1950),
        case(gauges + team_b_c, 975),
        case(gauges + idle, 0)]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    done = subprocess.run([_promtool(), "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_alerts_default_threshold_is_the_servers() -> None:
    """The alert's fallback for tenants without a gauge is DEFAULT_SLO_P95_S, and the SLO bound is the latency
    histogram's largest finite bucket (a p95 read from it never goes higher)."""
    from server.metrics import LATENCY_BUCKETS
    from server.tenant_config import DEFAULT_SLO_P95_S, MAX_SLO_P95_S

    rule = yaml.safe_load((RULES / "tenant_alerts.yml").read_text())["groups"][0]["rules"][0]
    assert rule["alert"] == "SdserveTenantP95SloBurn"
    assert rule["expr"].endswith(f") > {DEFAULT_SLO_P95_S:g}") and "unless on (tenant)" in rule["expr"]
    assert LATENCY_BUCKETS[-1] == MAX_SLO_P95_S
