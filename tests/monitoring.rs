//! The monitoring artefacts, checked by the real third-party tools that
//! will consume them (nothing is skipped; a missing tool fails with the
//! command that installs it):
//!
//! - `promtool check rules` on the alerts (`config/monitoring/prometheusrule.yaml`
//!   and any PrometheusRule the chart renders);
//! - `promtool test rules` with `tests/monitoring/alerts.test.yaml`: every
//!   alert fires when it should and stays quiet when it should not, and an
//!   alert without such cases fails the test;
//! - the Grafana dashboard: every panel that shows data has a unit, and every
//!   query, Grafana variables substituted, parses with Prometheus's PromQL
//!   parser (`promtool check rules` on the queries as recording rules);
//! - `kubectl apply --dry-run=server --validate=strict` of config/monitoring,
//!   config/autoscaling and the chart with its monitoring options, against a
//!   real kube-apiserver holding prometheus-operator's and KEDA's own CRDs;
//! - KEDA's own admission checks (`tests/keda`: the pure part of its
//!   validating webhook, at the KEDA version pinned there) on every
//!   ScaledObject of config/autoscaling;
//! - config/monitoring's ServiceMonitor and the chart's coexist in one
//!   namespace, and its selector picks the controller Service of both
//!   config/default and the chart.
//!
//! Each check is also run on a deliberately broken copy and must fail.
//!
//! promtool: `tests/promtool/install.sh` (or `LANEKEEPER_PROMTOOL`); helm:
//! `tests/helm/install.sh` (or `LANEKEEPER_HELM`); the CRDs:
//! `tests/monitoring/crds.sh`. All three build or fetch from the Go module
//! proxy at pinned versions into `${LANEKEEPER_CACHE:-~/.cache/lanekeeper}`.
//! Whether the metrics named are served is `tests/packaging.rs`'s job (it
//! runs a controller and a worker).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use serde::Deserialize;
use serde_yaml::Value;
use support::controlplane::{self, ControlPlane};
use support::process;
use support::tools::{helm_ok, installed};

const RULES: &str = "config/monitoring/prometheusrule.yaml";
const ALERT_TESTS: &str = "tests/monitoring/alerts.test.yaml";
const DASHBOARD: &str = "config/monitoring/grafana-dashboard.json";
const SERVICE_MONITOR: &str = "config/monitoring/servicemonitor-controller.yaml";
/// The name `promtool test rules` finds the extracted rules under (the
/// test file's `rule_files`).
const EXTRACTED_RULES: &str = "prometheusrule.rules.yaml";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    let path = repo().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).expect("valid YAML")
}

fn docs(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).expect("valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn to_yaml(v: &Value) -> String {
    serde_yaml::to_string(v).unwrap()
}

fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

// ---------------------------------------------------------------- the tools

fn promtool_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        installed(
            "tests/promtool/install.sh",
            "promtool",
            "LANEKEEPER_PROMTOOL",
        )
    })
}

/// prometheus-operator's and KEDA's CRD files (`tests/monitoring/crds.sh`).
fn crd_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| installed("tests/monitoring/crds.sh", "", "LANEKEEPER_MONITORING_CRDS"))
}

fn kubectl_present() {
    static OK: OnceLock<()> = OnceLock::new();
    OK.get_or_init(|| {
        let ok = Command::new("kubectl")
            .args(["version", "--client"])
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            ok,
            "kubectl is missing: install it (`apt-get install kubectl` from the Kubernetes apt \
             repository, or https://kubernetes.io/docs/tasks/tools/) and rerun"
        );
    });
}

fn promtool(args: &[&str], dir: &Path) -> Output {
    Command::new(promtool_bin())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool")
}

/// The chart's monitoring options, switched on (ingest too, for its
/// ServiceMonitor).
fn monitoring_options(ns: &str) -> Vec<String> {
    vec![
        "metrics.serviceMonitor.enabled=true".into(),
        "metrics.serviceMonitor.labels.release=prometheus".into(),
        "ingest.enabled=true".into(),
        format!("ingest.shardSet={ns}/webhooks"),
    ]
}

/// `helm template <release> charts/lanekeeper -n <ns> --set <set>...`.
fn render_chart(release: &str, ns: &str, set: &[String]) -> String {
    let mut args: Vec<&str> = vec!["template", release, "charts/lanekeeper", "--namespace", ns];
    for s in set {
        args.extend(["--set", s.as_str()]);
    }
    helm_ok(&args)
}

fn kustomize(dir: &str) -> String {
    kubectl_present();
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(repo().join(dir))
        .output()
        .expect("run kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {dir} failed:\n{}",
        output_text(&out)
    );
    String::from_utf8(out.stdout).unwrap()
}

// ---------------------------------------------------------------- rules

/// `promtool check rules` on a rule file's text (groups: ...).
fn check_rules(rules: &str) -> Result<String, String> {
    let dir = process::scratch_dir("promtool-check");
    std::fs::write(dir.join("rules.yaml"), rules).unwrap();
    let out = promtool(&["check", "rules", "rules.yaml"], &dir);
    if out.status.success() {
        Ok(output_text(&out))
    } else {
        Err(output_text(&out))
    }
}

/// `promtool test rules` of `tests` (a unit-test file) against `rules`.
fn test_rules(rules: &str, tests: &str) -> Result<String, String> {
    let dir = process::scratch_dir("promtool-test");
    std::fs::write(dir.join(EXTRACTED_RULES), rules).unwrap();
    std::fs::write(dir.join("alerts.test.yaml"), tests).unwrap();
    let out = promtool(&["test", "rules", "alerts.test.yaml"], &dir);
    if out.status.success() {
        Ok(output_text(&out))
    } else {
        Err(output_text(&out))
    }
}

/// The rule file a PrometheusRule holds: its `spec`.
fn rule_spec(prometheus_rule: &Value) -> String {
    assert_eq!(prometheus_rule["kind"], "PrometheusRule");
    to_yaml(&prometheus_rule["spec"])
}

/// Every PrometheusRule the repository ships: config/monitoring's and the
/// chart's (rendered with its monitoring options), by where they come from.
fn prometheus_rules() -> Vec<(String, Value)> {
    let mut out = vec![(RULES.to_string(), yaml(&read(RULES)))];
    let ns = "lanekeeper-system";
    for d in docs(&render_chart("lanekeeper", ns, &monitoring_options(ns))) {
        if d["kind"] == "PrometheusRule" {
            out.push((
                format!("chart: PrometheusRule {:?}", d["metadata"]["name"]),
                d,
            ));
        }
    }
    out
}

/// What the unit tests lack: alerts with no case expecting them to fire or
/// none expecting them quiet, recording rules no `promql_expr_test` names.
fn untested_rules(rules: &Value, tests: &Value) -> Vec<String> {
    let mut fires = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    let mut exprs = String::new();
    for group in tests["tests"].as_sequence().into_iter().flatten() {
        for case in group["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = case["alertname"].as_str().unwrap_or_default().to_string();
            let expected = case["exp_alerts"].as_sequence().map_or(0, |s| s.len());
            if expected > 0 {
                fires.insert(name);
            } else {
                quiet.insert(name);
            }
        }
        for case in group["promql_expr_test"]
            .as_sequence()
            .into_iter()
            .flatten()
        {
            exprs.push_str(case["expr"].as_str().unwrap_or_default());
            exprs.push('\n');
        }
    }
    let mut missing = Vec::new();
    for group in rules["groups"].as_sequence().into_iter().flatten() {
        for rule in group["rules"].as_sequence().into_iter().flatten() {
            if let Some(alert) = rule["alert"].as_str() {
                if !fires.contains(alert) {
                    missing.push(format!(
                        "alert {alert}: no `alertname: {alert}` case with exp_alerts (it fires)"
                    ));
                }
                if !quiet.contains(alert) {
                    missing.push(format!(
                        "alert {alert}: no `alertname: {alert}` case with `exp_alerts: []` (it stays quiet)"
                    ));
                }
            }
            if let Some(record) = rule["record"].as_str() {
                let named = exprs.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'));
                if !named.into_iter().any(|w| w == record) {
                    missing.push(format!(
                        "recording rule {record}: no promql_expr_test names it"
                    ));
                }
            }
        }
    }
    missing
}

#[test]
fn alerts_pass_promtool_check_rules() {
    let t = Instant::now();
    for (source, rule) in prometheus_rules() {
        let out = check_rules(&rule_spec(&rule))
            .unwrap_or_else(|e| panic!("promtool check rules refuses {source}:\n{e}"));
        eprintln!("{source}: {}", out.trim());
    }
    // A broken expression is refused.
    let mut broken = yaml(&read(RULES));
    broken["spec"]["groups"][1]["rules"][0]["expr"] =
        Value::from("max by (namespace, shard_set (lanekeeper_skew_ratio) > 3");
    let err = check_rules(&rule_spec(&broken)).expect_err("a broken expression must be refused");
    eprintln!("broken copy, as expected:\n{err}");
    assert!(err.contains("parse error"), "{err}");
    // So is a rule with a misspelt field.
    let broken = read(RULES).replacen("    for: 10m", "    fore: 10m", 1);
    let err =
        check_rules(&rule_spec(&yaml(&broken))).expect_err("an unknown field must be refused");
    eprintln!("misspelt field, as expected:\n{err}");
    assert!(err.contains("fore"), "{err}");
    eprintln!("promtool check rules in {:.1}s", t.elapsed().as_secs_f64());
}

#[test]
fn every_alert_has_unit_tests_and_they_pass() {
    let t = Instant::now();
    let rule = yaml(&read(RULES));
    let spec = rule_spec(&rule);
    let tests_text = read(ALERT_TESTS);
    let tests = yaml(&tests_text);
    assert_eq!(
        tests["rule_files"][0].as_str(),
        Some(EXTRACTED_RULES),
        "{ALERT_TESTS} must name the extracted rules as {EXTRACTED_RULES}"
    );
    let missing = untested_rules(&yaml(&spec), &tests);
    assert!(
        missing.is_empty(),
        "rules without unit tests in {ALERT_TESTS}:\n{}",
        missing.join("\n")
    );
    let out = test_rules(&spec, &tests_text)
        .unwrap_or_else(|e| panic!("promtool test rules {ALERT_TESTS} fails:\n{e}"));
    eprintln!("{}", out.trim());

    // A new alert without a case is caught.
    let mut new = yaml(&spec);
    let extra = yaml(
        "alert: LanekeeperSomethingNew\nexpr: lanekeeper_shards == 0\nfor: 5m\nlabels: {severity: warning}\n",
    );
    new["groups"][0]["rules"]
        .as_sequence_mut()
        .unwrap()
        .push(extra);
    let missing = untested_rules(&new, &tests);
    eprintln!(
        "an alert without unit tests, as expected:\n{}",
        missing.join("\n")
    );
    assert_eq!(missing.len(), 2, "{missing:?}");
    assert!(missing[0].contains("LanekeeperSomethingNew"), "{missing:?}");
    // So is a recording rule no test names.
    let mut new = yaml(&spec);
    let extra = yaml("record: lanekeeper:queue_depth:sum\nexpr: sum(lanekeeper_queue_depth)\n");
    new["groups"][0]["rules"]
        .as_sequence_mut()
        .unwrap()
        .push(extra);
    assert_eq!(untested_rules(&new, &tests).len(), 1);

    // The tests see a broken threshold: with the whale exclusion at 0.5
    // instead of 0.10, the whale's own wait would page.
    let loose = spec.replace(
        "(lanekeeper_tenant_capacity_share > 0.10)",
        "(lanekeeper_tenant_capacity_share > 0.5)",
    );
    assert_ne!(loose, spec, "the whale exclusion moved; update this test");
    let err = test_rules(&loose, &tests_text).expect_err("a broken whale exclusion must fail");
    eprintln!("whale exclusion broken, as expected:\n{err}");
    assert!(err.contains("LanekeeperSmallTenantWaitOverSLO"), "{err}");
    // And a broken `for:`.
    let quick = spec.replacen("for: 30m", "for: 20m", 1);
    let err = test_rules(&quick, &tests_text).expect_err("a shorter `for:` must fail");
    assert!(err.contains("LanekeeperLaneCapReached"), "{err}");
    eprintln!("promtool test rules in {:.1}s", t.elapsed().as_secs_f64());
}

// ---------------------------------------------------------------- dashboard

/// Panels (rows' nested panels included) that show data, i.e. have targets.
fn data_panels(dash: &serde_json::Value) -> Vec<&serde_json::Value> {
    fn walk<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
        for p in v.as_array().into_iter().flatten() {
            if p["targets"].as_array().is_some_and(|t| !t.is_empty()) {
                out.push(p);
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], &mut out);
    out
}

fn panels_without_unit(dash: &serde_json::Value) -> Vec<String> {
    data_panels(dash)
        .into_iter()
        .filter(|p| {
            p["fieldConfig"]["defaults"]["unit"]
                .as_str()
                .is_none_or(str::is_empty)
        })
        .map(|p| {
            format!(
                "panel {} {:?}",
                p["id"],
                p["title"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

/// A value for each of the dashboard's variables, as Grafana would put it
/// in a query: "All" of a multi-value query variable is its allValue.
fn variable_values(dash: &serde_json::Value) -> BTreeMap<String, String> {
    let mut vars: BTreeMap<String, String> = [
        ("__rate_interval", "1m"),
        ("__interval", "30s"),
        ("__interval_ms", "30000"),
        ("__range", "1h"),
        ("__range_s", "3600"),
        ("__range_ms", "3600000"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        let name = v["name"]
            .as_str()
            .expect("a variable has a name")
            .to_string();
        let current = &v["current"]["value"];
        let current = current
            .as_str()
            .or_else(|| current.as_array().and_then(|a| a.first()?.as_str()))
            .map(str::to_string);
        let value = match v["type"].as_str().unwrap_or_default() {
            "datasource" => continue,
            _ if current.as_deref() == Some("$__all") || v["includeAll"] == true => {
                v["allValue"].as_str().unwrap_or(".*").to_string()
            }
            "constant" | "textbox" => v["query"].as_str().unwrap_or_default().to_string(),
            _ => current
                .or_else(|| v["options"][0]["value"].as_str().map(str::to_string))
                .unwrap_or_else(|| panic!("variable {name} has no value to substitute")),
        };
        vars.insert(name, value);
    }
    vars
}

/// `expr` with Grafana's variables (`$name`, `${name}`, `${name:format}`,
/// `[[name]]`) replaced; an unknown variable is an error.
fn substitute(expr: &str, vars: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = expr;
    while let Some(i) = rest.find(['$', '[']) {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        let (name, len) = if let Some(r) = tail.strip_prefix("${") {
            let end = r
                .find('}')
                .ok_or_else(|| format!("unclosed ${{ in {expr}"))?;
            (r[..end].split(':').next().unwrap(), end + 3)
        } else if let Some(r) = tail.strip_prefix("[[") {
            let end = r
                .find("]]")
                .ok_or_else(|| format!("unclosed [[ in {expr}"))?;
            (r[..end].split(':').next().unwrap(), end + 4)
        } else if let Some(r) = tail.strip_prefix('$') {
            let end = r
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(r.len());
            (&r[..end], end + 1)
        } else {
            // A plain `[` (a range).
            out.push('[');
            rest = &tail[1..];
            continue;
        };
        let value = vars
            .get(name)
            .ok_or_else(|| format!("unknown Grafana variable ${name} in {expr}"))?;
        out.push_str(value);
        rest = &tail[len..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Every query of the dashboard, variables substituted, as `(where, PromQL)`:
/// panel targets and the selectors of `label_values(...)` variables.
fn dashboard_queries(dash: &serde_json::Value) -> Result<Vec<(String, String)>, String> {
    let vars = variable_values(dash);
    let mut out = Vec::new();
    for p in data_panels(dash) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let Some(e) = t["expr"].as_str() else {
                continue;
            };
            let id = format!("panel_{}_{}", p["id"], t["refId"].as_str().unwrap_or("A"));
            out.push((id, substitute(e, &vars)?));
        }
    }
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap_or_default();
        let sel = q
            .strip_prefix("label_values(")
            .and_then(|r| r.rsplit_once(','))
            .map(|(sel, _)| sel)
            .ok_or_else(|| {
                format!(
                    "variable {} is not label_values(<selector>, <label>): {q}",
                    v["name"]
                )
            })?;
        let name = v["name"].as_str().unwrap_or_default();
        out.push((format!("variable_{name}"), substitute(sel, &vars)?));
    }
    Ok(out)
}

/// The dashboard's problems: panels without a unit, and queries that
/// Prometheus's parser refuses (`promtool check rules` on them as
/// recording rules `panel_<id>_<refId>`).
fn check_dashboard(dash: &serde_json::Value) -> Result<usize, String> {
    let mut problems = panels_without_unit(dash)
        .into_iter()
        .map(|p| format!("{p} has no unit (fieldConfig.defaults.unit)"))
        .collect::<Vec<_>>();
    let queries = dashboard_queries(dash)?;
    let rules: Vec<Value> = queries
        .iter()
        .map(|(id, e)| {
            serde_yaml::to_value(BTreeMap::from([
                ("record", id.as_str()),
                ("expr", e.as_str()),
            ]))
            .unwrap()
        })
        .collect();
    let file = serde_yaml::to_value(BTreeMap::from([(
        "groups",
        vec![serde_yaml::to_value(BTreeMap::from([
            ("name", Value::from("dashboard")),
            ("rules", Value::Sequence(rules)),
        ]))
        .unwrap()],
    )]))
    .unwrap();
    if let Err(e) = check_rules(&to_yaml(&file)) {
        problems.push(format!("promtool refuses a query:\n{e}"));
    }
    if problems.is_empty() {
        Ok(queries.len())
    } else {
        Err(problems.join("\n"))
    }
}

/// Every Grafana dashboard shipped: config/monitoring's JSON, and any
/// dashboard ConfigMap the chart renders with its monitoring options.
fn dashboards() -> Vec<(String, serde_json::Value)> {
    let mut out = vec![(
        DASHBOARD.to_string(),
        serde_json::from_str(&read(DASHBOARD)).expect("the dashboard is JSON"),
    )];
    let ns = "lanekeeper-system";
    for d in docs(&render_chart("lanekeeper", ns, &monitoring_options(ns))) {
        if d["kind"] != "ConfigMap" {
            continue;
        }
        for (k, v) in d["data"].as_mapping().into_iter().flatten() {
            let key = k.as_str().unwrap_or_default();
            if key.ends_with(".json") {
                let json = serde_json::from_str(v.as_str().unwrap_or_default())
                    .unwrap_or_else(|e| panic!("chart ConfigMap {key} is not JSON: {e}"));
                out.push((format!("chart: ConfigMap data {key}"), json));
            }
        }
    }
    out
}

#[test]
fn dashboard_panels_have_units_and_their_queries_parse() {
    let t = Instant::now();
    for (source, dash) in dashboards() {
        let n = check_dashboard(&dash).unwrap_or_else(|e| panic!("{source}:\n{e}"));
        eprintln!("{source}: {n} queries parse, every data panel has a unit");
    }
    let vars = variable_values(&serde_json::from_str(&read(DASHBOARD)).unwrap());
    assert_eq!(
        substitute(
            r#"topk(${topk}, x{a=~"$namespace"}[$__rate_interval]) [[small_share]]"#,
            &vars
        )
        .unwrap(),
        r#"topk(10, x{a=~".*"}[1m]) 0.10"#
    );

    // A panel without a unit is caught.
    let mut broken: serde_json::Value = serde_json::from_str(&read(DASHBOARD)).unwrap();
    let p = data_panels_mut(&mut broken, 6);
    p["fieldConfig"]["defaults"]
        .as_object_mut()
        .unwrap()
        .remove("unit");
    let err = check_dashboard(&broken).expect_err("a panel without a unit must be refused");
    eprintln!("panel without a unit, as expected:\n{err}");
    assert!(err.contains("panel 6"), "{err}");
    // So is a query that does not parse.
    let mut broken: serde_json::Value = serde_json::from_str(&read(DASHBOARD)).unwrap();
    let p = data_panels_mut(&mut broken, 12);
    p["targets"][0]["expr"] = serde_json::Value::from(
        r#"sum by (class) (rate(lanekeeper_deliveries_total{namespace=~"$namespace"}[$__rate_interval])"#,
    );
    let err = check_dashboard(&broken).expect_err("a query that does not parse must be refused");
    eprintln!("unparsable query, as expected:\n{err}");
    assert!(err.contains("panel_12_A"), "{err}");
    // And a variable the dashboard does not define.
    let mut broken: serde_json::Value = serde_json::from_str(&read(DASHBOARD)).unwrap();
    let p = data_panels_mut(&mut broken, 18);
    p["targets"][0]["expr"] =
        serde_json::Value::from(r#"sum by (queue) (lanekeeper_in_flight{queue=~"$queue"})"#);
    let err = check_dashboard(&broken).expect_err("an unknown variable must be refused");
    assert!(err.contains("$queue"), "{err}");
    eprintln!("dashboard checks in {:.1}s", t.elapsed().as_secs_f64());
}

fn data_panels_mut(dash: &mut serde_json::Value, id: u64) -> &mut serde_json::Value {
    dash["panels"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| p["id"] == id)
        .unwrap_or_else(|| panic!("no panel {id}"))
}

// ---------------------------------------------------------------- the API server

/// One cluster-changing step at a time.
static CLUSTER: Mutex<()> = Mutex::new(());

/// The test API server with prometheus-operator's and KEDA's CRDs
/// Established, and the namespaces config/monitoring and config/autoscaling
/// name.
fn cluster() -> &'static ControlPlane {
    static READY: OnceLock<()> = OnceLock::new();
    kubectl_present();
    let cp = controlplane::api_server();
    READY.get_or_init(|| {
        let dir = crd_dir();
        let t = Instant::now();
        let mut names = Vec::new();
        for f in [
            "monitoring.coreos.com_servicemonitors.yaml",
            "monitoring.coreos.com_podmonitors.yaml",
            "monitoring.coreos.com_prometheusrules.yaml",
            "keda.sh_scaledobjects.yaml",
        ] {
            let path = dir.join(f);
            // Server-side: the CRDs are too large for the last-applied annotation.
            cp.kubectl_ok(&["apply", "--server-side", "-f", &path.display().to_string()]);
            names.push(format!(
                "crd/{}",
                yaml(&std::fs::read_to_string(&path).unwrap())["metadata"]["name"]
                    .as_str()
                    .unwrap()
            ));
        }
        let mut args = vec!["wait", "--for=condition=Established", "--timeout=60s"];
        args.extend(names.iter().map(String::as_str));
        cp.kubectl_ok(&args);
        cp.kubectl_ok(&[
            "apply",
            "-f",
            &repo()
                .join("config/default/namespace.yaml")
                .display()
                .to_string(),
        ]);
        cp.kubectl_ok(&["create", "namespace", "webhooks"]);
        eprintln!(
            "prometheus-operator and KEDA CRDs Established in {:.1}s",
            t.elapsed().as_secs_f64()
        );
    });
    cp
}

/// `kubectl apply --dry-run=server --validate=strict` of `manifests`.
fn apply_strict(cp: &ControlPlane, manifests: &str) -> Result<String, String> {
    let out = cp.kubectl_stdin_output(
        &["apply", "--dry-run=server", "--validate=strict", "-f", "-"],
        manifests,
    );
    if out.status.success() {
        Ok(output_text(&out))
    } else {
        Err(output_text(&out))
    }
}

/// `keda-check` (`tests/keda/install.sh`, or `LANEKEEPER_KEDA_CHECK`) on
/// `files`: Ok(its report) when KEDA's checks accept every ScaledObject.
fn keda_check(files: &[PathBuf]) -> Result<String, String> {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    let bin = BIN.get_or_init(|| {
        installed(
            "tests/keda/install.sh",
            "keda-check",
            "LANEKEEPER_KEDA_CHECK",
        )
    });
    let out = Command::new(bin)
        .args(files)
        .output()
        .expect("run keda-check");
    let text = output_text(&out);
    match out.status.code() {
        Some(0) => Ok(text),
        Some(1) => Err(text),
        _ => panic!("keda-check could not check {files:?}:\n{text}"),
    }
}

#[test]
fn autoscaling_examples_pass_kedas_own_admission_checks() {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(repo().join("config/autoscaling")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            files.push(path);
        }
    }
    files.sort();
    let report = keda_check(&files).unwrap_or_else(|e| panic!("KEDA refuses:\n{e}"));
    eprintln!("{report}");
    assert_eq!(
        report.matches(": accepted").count(),
        files.len(),
        "{report}"
    );

    // What the CRD schema lets through and KEDA's webhook does not.
    let dir = process::scratch_dir("keda-check");
    let example = read("config/autoscaling/keda-scaledobject.yaml");
    let breaks = [
        (
            "a minimum above the maximum",
            example.replace("minReplicaCount: 1", "minReplicaCount: 30"),
            "must be less than MaxReplicaCount",
        ),
        (
            "a negative fallback",
            example.replace("    replicas: 4", "    replicas: -1"),
            "greater than or equal to 0",
        ),
        (
            "two triggers of one name",
            example.replace(
                "    - type: prometheus\n",
                "    - type: prometheus\n      name: drain\n      metadata: {serverAddress: http://p:9090, query: up, threshold: \"1\"}\n    - type: prometheus\n      name: drain\n",
            ),
            "is defined multiple times",
        ),
    ];
    for (what, broken, says) in breaks {
        assert_ne!(broken, example, "{what}: the break did not apply");
        let path = dir.join("broken.yaml");
        std::fs::write(&path, &broken).unwrap();
        let err = keda_check(&[path]).expect_err(what);
        eprintln!("{what}, as expected: {err}");
        assert!(err.contains(says), "{what}: {err}");
    }
}

#[test]
fn monitoring_objects_pass_strict_server_side_validation() {
    let cp = cluster();
    let t = Instant::now();
    let monitoring = kustomize("config/monitoring");
    let out = {
        // Not while the coexistence test creates the same objects for real.
        let _one = CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        apply_strict(cp, &monitoring)
    }
    .unwrap_or_else(|e| panic!("config/monitoring is refused:\n{e}"));
    for want in [
        "servicemonitor.monitoring.coreos.com/",
        "podmonitor.monitoring.coreos.com/lanekeeper-workers",
        "prometheusrule.monitoring.coreos.com/lanekeeper",
        "configmap/lanekeeper-dashboard",
    ] {
        assert!(out.contains(want), "{want} not applied:\n{out}");
    }
    let mut autoscaling = Vec::new();
    for entry in std::fs::read_dir(repo().join("config/autoscaling")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            autoscaling.push(std::fs::read_to_string(&path).unwrap());
        }
    }
    let out = apply_strict(cp, &autoscaling.join("\n---\n"))
        .unwrap_or_else(|e| panic!("config/autoscaling is refused:\n{e}"));
    assert!(
        out.contains("scaledobject.keda.sh/webhooks-shard-03"),
        "{out}"
    );

    let ns = cp.namespace("lk-monitoring");
    let chart = render_chart("lk", &ns, &monitoring_options(&ns));
    let monitors = docs(&chart)
        .iter()
        .filter(|d| d["kind"] == "ServiceMonitor")
        .count();
    assert_eq!(
        monitors, 2,
        "the chart's controller and ingest ServiceMonitors"
    );
    let out = apply_strict(cp, &chart)
        .unwrap_or_else(|e| panic!("the chart with its monitoring options is refused:\n{e}"));
    assert!(
        out.contains("servicemonitor.monitoring.coreos.com/lk-lanekeeper-ingest"),
        "{out}"
    );

    // A misspelt field is refused, as are a wrong type and an unknown kind field.
    let sm = read(SERVICE_MONITOR);
    // (Under another name: the coexistence test applies the real one.)
    let broken = sm
        .replace("honorLabels:", "honourLabels:")
        .replace("name: lanekeeper-controller-metrics", "name: misspelt");
    assert_ne!(broken, sm);
    let err =
        apply_strict(cp, &broken).expect_err("a misspelt ServiceMonitor field must be refused");
    eprintln!("misspelt ServiceMonitor field, as expected:\n{err}");
    assert!(
        err.contains("unknown field") && err.contains("honourLabels"),
        "{err}"
    );
    let broken = read("config/autoscaling/keda-scaledobject.yaml")
        .replace("minReplicaCount: 1", "minReplicaCount: one");
    let err =
        apply_strict(cp, &broken).expect_err("a ScaledObject with a string count must be refused");
    eprintln!("ScaledObject minReplicaCount: one, as expected:\n{err}");
    eprintln!(
        "config/monitoring, config/autoscaling and the chart validated in {:.1}s",
        t.elapsed().as_secs_f64()
    );
}

/// The Services in `ns` that `monitor`'s selector picks.
fn selected_services(cp: &ControlPlane, ns: &str, monitor: &Value) -> BTreeSet<String> {
    let labels: Vec<String> = monitor["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .expect("the ServiceMonitor selects by matchLabels")
        .iter()
        .map(|(k, v)| format!("{}={}", k.as_str().unwrap(), v.as_str().unwrap()))
        .collect();
    assert!(
        monitor["spec"]["selector"]["matchExpressions"].is_null(),
        "update selected_services for matchExpressions"
    );
    cp.kubectl_ok(&[
        "get",
        "services",
        "-n",
        ns,
        "-l",
        &labels.join(","),
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ])
    .split_whitespace()
    .map(str::to_string)
    .collect()
}

#[test]
fn config_monitoring_and_the_chart_servicemonitors_coexist_and_select_both_installs() {
    let cp = cluster();
    let t = Instant::now();
    let ours = yaml(&read(SERVICE_MONITOR));
    let ns = "lanekeeper-system";
    assert_eq!(ours["metadata"]["namespace"], ns);
    let release_ns = strs(&ours["spec"]["namespaceSelector"]["matchNames"]);
    assert_eq!(
        release_ns,
        vec![ns.to_string()],
        "where config/default installs"
    );
    {
        let _one = CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        // Both for real, in one namespace: config/monitoring first, then the
        // chart as the README installs it (release "lanekeeper").
        cp.kubectl_ok(&[
            "apply",
            "-k",
            &repo().join("config/monitoring").display().to_string(),
        ]);
        helm_ok(&[
            "install",
            "lanekeeper",
            "charts/lanekeeper",
            "--namespace",
            ns,
            "--kubeconfig",
            &cp.kubeconfig.display().to_string(),
            "--set",
            "metrics.serviceMonitor.enabled=true",
        ]);
    }
    let monitors: BTreeSet<String> = cp
        .kubectl_ok(&[
            "get",
            "servicemonitors",
            "-n",
            ns,
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let name = ours["metadata"]["name"].as_str().unwrap().to_string();
    assert_eq!(
        monitors,
        [name.clone(), "lanekeeper-controller".to_string()].into(),
        "config/monitoring's ServiceMonitor and the chart's, side by side"
    );
    // config/monitoring's was not taken over by the release.
    let managed = cp.kubectl_ok(&[
        "get",
        "servicemonitor",
        &name,
        "-n",
        ns,
        "-o",
        "jsonpath={.metadata.labels.app\\.kubernetes\\.io/managed-by}",
    ]);
    assert_ne!(managed, "Helm");

    // The selector picks the chart's controller Service (release "lanekeeper")...
    assert_eq!(
        selected_services(cp, ns, &ours),
        ["lanekeeper-controller-metrics".to_string()].into()
    );
    // ... and, in a namespace of their own, config/default's Service and the
    // chart's under another release name, but not the ingest Service.
    let scratch = cp.namespace("lk-selector");
    let mut svc = docs(&kustomize("config/default"))
        .into_iter()
        .find(|d| d["kind"] == "Service")
        .expect("config/default has a Service");
    assert_eq!(svc["metadata"]["namespace"], ns);
    svc["metadata"]["namespace"] = Value::from(scratch.clone());
    cp.kubectl_stdin(&["apply", "-f", "-"], &to_yaml(&svc));
    let chart: Vec<String> = docs(&render_chart(
        "other",
        &scratch,
        &monitoring_options(&scratch),
    ))
    .into_iter()
    .filter(|d| d["kind"] == "Service")
    .map(|d| to_yaml(&d))
    .collect();
    assert_eq!(chart.len(), 2, "the controller and ingest Services");
    cp.kubectl_stdin(&["apply", "-f", "-"], &chart.join("---\n"));
    assert_eq!(
        selected_services(cp, &scratch, &ours),
        [
            "lanekeeper-controller-metrics".to_string(),
            "other-lanekeeper-controller-metrics".to_string()
        ]
        .into()
    );
    eprintln!(
        "ServiceMonitors side by side and selectors checked in {:.1}s",
        t.elapsed().as_secs_f64()
    );
}

fn strs(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| {
            s.iter()
                .map(|x| x.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}
