"""pvschedd under a real Prometheus (Debian's 2.42, scripts/setup.d/47-prometheus.sh).

A real pvschedd (root, BPF) with its own socket and state directory under
the test's tmp dir, metrics on a free localhost port behind a bearer token
(`metrics_token_file`); one VM registered by the reference VMM on real KVM
(`pvsched run --policy daemon`, 2 vCPUs); a real Prometheus scraping it
every second with `authorization: {credentials_file: ...}` and
evaluating dist/prometheus/pvsched.rules.yml. Through Prometheus's HTTP API
the test checks the target is up, the per-VM, per-thread and daemon-wide
series carry the labels and values metrics.rs gives them (VM names, since
the token is sent), the recording rules produce series, every rule group
is loaded and healthy, and, once the VMM is gone, PvschedVmGone goes
pending for that VM. promtool checks the rule file, runs its unit tests
(dist/prometheus/pvsched.rules.test.yml: each alert fires on synthetic
series) and lints a real scrape of pvschedd's endpoint.

Run alone (as root, after scripts/setup):

    /usr/bin/python3 -B -m pytest -v tests/prometheus

Every wait is bounded (a liveness bound, not a timing assertion); every
process started here is stopped in `finally`, and gets SIGKILL if pytest
itself dies.
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from pvsched_guest.host import die_with_parent, kill
from pvsched_guest.host import wait_for as host_wait_for

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "dist" / "prometheus" / "pvsched.rules.yml"
RULES_TEST = REPO / "dist" / "prometheus" / "pvsched.rules.test.yml"
# The rules name the scrape job `pvsched` (PvschedDown, PvschedVmGone).
JOB = "pvsched"
VM = "prom-1"
VCPUS = 2
# Longer than the test's live part: the test stops the run itself.
RUN_DURATION = "120s"
# Liveness bound of every wait (not a timing assertion).
WAIT_S = 40


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, token=None, timeout=5):
    """(status, body) of GET url (status None if nothing answered)."""
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None, ""


def wait_for(what, probe, procs=(), timeout=WAIT_S, interval=0.25):
    """host.wait_for with this test's bound and polling interval."""
    return host_wait_for(what, probe, procs, timeout, interval)


def promtool(*args, stdin=None):
    return subprocess.run(["promtool", *map(str, args)], input=stdin, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)


@pytest.fixture(scope="module")
def prom_tools(need_real):
    missing = [t for t in ("prometheus", "promtool") if shutil.which(t) is None]
    if missing:
        need_real(" and ".join(missing),
                  "install Debian's prometheus package (scripts/setup, setup.d/47-prometheus.sh)")


@pytest.fixture(scope="module")
def pvsched_bins(need_real, release_bins):
    """pvschedd and pvsched (the session's release build, tests/conftest.py)."""
    if os.geteuid() != 0:
        need_real("root", "pvschedd loads the BPF policy and changes threads' scheduling")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        need_real("/dev/kvm", "the reference VMM registers a real KVM VM")
    return release_bins.pvschedd, release_bins.pvsched


def test_rules_check_and_unit_tests(prom_tools):
    """promtool accepts the rule file, and each alert fires (and stays
    quiet) on the synthetic series of its unit tests."""
    r = promtool("check", "rules", RULES)
    print(r.stdout)
    assert r.returncode == 0, r.stdout
    assert "SUCCESS" in r.stdout
    r = promtool("test", "rules", RULES_TEST)
    print(r.stdout)
    assert r.returncode == 0, r.stdout


class Api:
    """Prometheus's HTTP API at base."""

    def __init__(self, base):
        self.base = base

    def get(self, path, **params):
        url = f"{self.base}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = http_get(url)
        if status != 200:
            return None
        doc = json.loads(body)
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr):
        """The instant vector of expr: [(labels, float value)]."""
        data = self.get("/api/v1/query", query=expr)
        if data is None:
            return []
        assert data["resultType"] == "vector", data
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]


def test_prometheus_scrapes_pvschedd(prom_tools, pvsched_bins, tmp_path):
    pvschedd_bin, pvsched_bin = pvsched_bins
    t0 = time.monotonic()
    phases = []

    def phase(name):
        phases.append(f"{name} +{time.monotonic() - t0:.1f}s")

    sock = tmp_path / "pvschedd.sock"
    vms = tmp_path / "vms"
    vms.mkdir()
    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "metrics.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    wrong_token_file = tmp_path / "wrong.token"
    wrong_token_file.write_text(secrets.token_urlsafe(24) + "\n")
    mport, pport = free_port(), free_port()
    target = f"127.0.0.1:{mport}"
    metrics_url = f"http://{target}/metrics"
    cfg = tmp_path / "pvschedd.toml"
    cfg.write_text(f'socket = "{sock}"\nruntime_dir = "{tmp_path}"\nsocket_group = ""\n'
                   f'vm_dir = "{vms}"\nmetrics_listen = "{target}"\n'
                   f'metrics_token_file = "{token_file}"\n')
    # JSON is YAML: no YAML library needed to write Prometheus's config.
    prom_cfg = tmp_path / "prometheus.yml"
    prom_cfg.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": JOB,
            "authorization": {"credentials_file": str(token_file)},
            "static_configs": [{"targets": [target]}],
        }, {
            # The same endpoint with a token pvschedd does not know.
            "job_name": f"{JOB}-wrong-token",
            "authorization": {"credentials_file": str(wrong_token_file)},
            "static_configs": [{"targets": [target]}],
        }],
    }, indent=2))
    logs = {n: tmp_path / f"{n}.log" for n in ("pvschedd", "run", "prometheus")}
    daemon = run = prom = None
    try:
        r = promtool("check", "config", prom_cfg)
        assert r.returncode == 0, r.stdout

        with open(logs["pvschedd"], "w") as f:
            daemon = subprocess.Popen([str(pvschedd_bin), "--config", str(cfg)], stdout=f,
                                      stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                      env={**os.environ, "RUST_LOG": "info"})
        dproc = [("pvschedd", daemon, logs["pvschedd"])]
        env = {**os.environ, "PVSCHED_SOCKET": str(sock)}

        def daemon_ready():
            if daemon.poll() == 6:
                # Exit code 6: the BPF policy could not load (pvschedd --help).
                pytest.fail(f"pvschedd: the BPF policy did not load:\n"
                            f"{logs['pvschedd'].read_text()}")
            return subprocess.run([str(pvsched_bin), "status"], env=env, timeout=10,
                                  stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL).returncode == 0
        wait_for("pvschedd's socket", daemon_ready, dproc)
        phase("pvschedd up")
        # Without the token: 401, and no figure leaks.
        status, body = http_get(metrics_url)
        assert status == 401, (status, body)

        with open(logs["run"], "w") as f:
            run = subprocess.Popen(
                [str(pvsched_bin), "run", "--policy", "daemon", "--daemon-socket", str(sock),
                 "--vm-name", VM, "--vcpus", str(VCPUS), "--workload", "wakeup",
                 "--duration", RUN_DURATION, "--device-mode", "in-process"],
                stdout=f, stderr=subprocess.STDOUT, preexec_fn=die_with_parent, env=env)
        procs = dproc + [("pvsched run", run, logs["run"])]

        def registered():
            status, body = http_get(metrics_url, token)
            return status == 200 and f'pvsched_vcpus{{vm="{VM}"}} {VCPUS}\n' in body and body
        scrape = wait_for(f"VM {VM} in pvschedd's metrics", registered, procs)
        phase("VM registered")

        # promtool lints a real scrape (with the VM's series in it).
        r = promtool("check", "metrics", stdin=scrape)
        problems = {line.strip() for line in r.stdout.splitlines() if line.strip()}
        print(f"promtool check metrics: exit {r.returncode}; {sorted(problems)}")
        assert r.returncode == 0 and not problems, f"promtool check metrics:\n{r.stdout}"

        with open(logs["prometheus"], "w") as f:
            prom = subprocess.Popen(
                ["prometheus", f"--config.file={prom_cfg}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{pport}"],
                stdout=f, stderr=subprocess.STDOUT, preexec_fn=die_with_parent, cwd=tmp_path)
        procs.append(("prometheus", prom, logs["prometheus"]))
        api = Api(f"http://127.0.0.1:{pport}")
        wait_for("Prometheus ready", lambda: http_get(f"{api.base}/-/ready")[0] == 200, procs)
        phase("Prometheus ready")

        def wait_target(job, health):
            def probe():
                data = api.get("/api/v1/targets", state="active") or {"activeTargets": []}
                ours = [t for t in data["activeTargets"] if t["labels"].get("job") == job]
                assert len(ours) <= 1, ours
                return ours and ours[0]["health"] == health and ours[0]
            return wait_for(f"target {job} {health}", probe, procs)
        t = wait_target(JOB, "up")
        assert t["scrapeUrl"] == metrics_url, t
        assert t["labels"]["instance"] == target, t
        assert t["lastError"] == "", t
        # A scraper with the wrong token gets nothing (HTTP 401).
        bad = wait_target(f"{JOB}-wrong-token", "down")
        assert "401" in bad["lastError"], bad
        print(f"target {JOB}-wrong-token: {bad['health']}, {bad['lastError']!r}")
        assert api.query(f'pvsched_vms{{job="{JOB}-wrong-token"}}') == []
        phase("target up")

        # A per-VM series: labelled by the VM's name (the token is sent).
        got = api.query(f'pvsched_vcpus{{vm="{VM}"}}')
        assert got == [({"__name__": "pvsched_vcpus", "job": JOB, "instance": target,
                         "vm": VM}, float(VCPUS))], got
        # Per-thread series: one per vCPU thread, `vm` and `thread` labels.
        got = api.query(f'pvsched_boosts_total{{vm="{VM}"}}')
        assert sorted(m["thread"] for m, _ in got) == [f"vcpu{i}" for i in range(VCPUS)], got
        assert all(set(m) == {"__name__", "job", "instance", "vm", "thread"} for m, _ in got), got
        # Daemon-wide series: no vm label.
        got = api.query(f'pvsched_vms{{job="{JOB}"}}')
        assert got == [({"__name__": "pvsched_vms", "job": JOB, "instance": target}, 1.0)], got
        got = api.query(f'pvsched_registrations_total{{job="{JOB}"}}')
        assert [v for _, v in got] == [1.0], got

        # Recording rules: rates need two scrapes, then one evaluation.
        rec = wait_for("recorded vm:pvsched_boosts:rate1m",
                       lambda: api.query(f'vm:pvsched_boosts:rate1m{{vm="{VM}"}}'), procs)
        assert [m for m, _ in rec] == [{"__name__": "vm:pvsched_boosts:rate1m", "job": JOB,
                                        "instance": target, "vm": VM}], rec
        share = wait_for("recorded vm:pvsched_vcpu_boosted_time:ratio_rate1m", lambda: api.query(
            f'vm:pvsched_vcpu_boosted_time:ratio_rate1m{{vm="{VM}"}}'), procs)
        assert len(share) == 1 and 0.0 <= share[0][1] <= 1.0, share
        phase("recording rules evaluated")

        def rules_healthy():
            data = api.get("/api/v1/rules")
            groups = {g["name"]: g for g in (data or {}).get("groups", [])}
            if set(groups) != {"pvsched.recording", "pvsched.alerts"}:
                return False
            rules = [r for g in groups.values() for r in g["rules"]]
            return all(r["health"] == "ok" for r in rules) and groups
        groups = wait_for("every rule evaluated with health ok", rules_healthy, procs)
        assert all(g["file"] == str(RULES) for g in groups.values()), groups
        alerts = {r["name"] for r in groups["pvsched.alerts"]["rules"]}
        assert alerts == {"PvschedDown", "PvschedVmThrottledOften", "PvschedRingDrops",
                          "PvschedSetattrErrors", "PvschedRestoreErrors", "PvschedVmGone"}, alerts
        assert all(r.get("lastError", "") == "" for g in groups.values() for r in g["rules"])
        active = api.get("/api/v1/alerts")["alerts"]
        assert active == [], f"alerts with a healthy pvschedd and one VM: {active}"
        phase("rules healthy")

        # The VMM is killed while its connection holds the registration:
        # pvschedd unregisters the VM (connection_closed, or vmm_exited if
        # the exit is seen first), its series go stale, and PvschedVmGone
        # is pending for it (firing only after its `for`) unless the
        # reason recorded is vmm_exited, a VM that ended normally.
        kill(run)
        procs = [p for p in procs if p[1] is not run]
        wait_for("pvsched_vms 0 in Prometheus",
                 lambda: [v for _, v in api.query(f'pvsched_vms{{job="{JOB}"}}')] == [0.0], procs)

        def gone_alert():
            data = api.get("/api/v1/alerts") or {"alerts": []}
            return [a for a in data["alerts"] if a["labels"]["alertname"] == "PvschedVmGone"]
        reasons = wait_for(
            "the VM's ended registration in Prometheus",
            lambda: [m["reason"] for m, _ in api.query(
                f'pvsched_vm_unregistered_timestamp_seconds{{job="{JOB}",vm="{VM}"}}')],
            procs)
        assert reasons in (["connection_closed"], ["vmm_exited"]), reasons
        if reasons == ["connection_closed"]:
            gone = wait_for("PvschedVmGone pending", gone_alert, procs)
            assert len(gone) == 1 and gone[0]["state"] in ("pending", "firing"), gone
            assert gone[0]["labels"] == {"alertname": "PvschedVmGone", "severity": "warning",
                                         "job": JOB, "instance": target, "vm": VM}, gone
            phase("PvschedVmGone pending")
        # ... and says why: the VMM's exit or its closed connection, and
        # every thread restored.
        ended = sum(v for _, v in api.query(
            f'pvsched_unregistrations_total{{job="{JOB}",reason=~"vmm_exited|connection_closed"}}'))
        assert ended == 1.0, ended
        assert [v for _, v in api.query(f'pvsched_restore_errors_total{{job="{JOB}"}}')] == [0.0]
        assert daemon.poll() is None, "pvschedd exited during the test"
    finally:
        for p in (prom, run, daemon):
            kill(p)
        print("phases: " + ", ".join(phases))
        print(f"whole test {time.monotonic() - t0:.1f}s")
    assert daemon.returncode == 0, f"pvschedd's exit on SIGTERM: {daemon.returncode}"
