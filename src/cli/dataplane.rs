//! `lanekeeper dataplane apply`: the data plane without Kubernetes. Reads
//! ShardSet YAML, checks it as the controller does, and writes into Redis
//! what the controller's Redis step writes for it, by the same call
//! (`controller::dataplane::apply_spec`): routing table (shard count, epoch
//! mark, durability), queue policies of every shard, tier assignments and
//! `spec.tenants`. Workers and ingest then run against that Redis as they
//! do under the operator.
//!
//! What needs Kubernetes is refused, naming the field: a URL or password
//! only in a Secret (`spec.redis.urlSecretRef`: give `--redis`), a tier
//! ConfigMap (`scheduler.tierAssignments`: give its text with
//! `--tiers-file`), and a change of the shard count of a set whose table
//! has one (a reshard moves tenants; only the controller runs it).

use std::path::PathBuf;

use anyhow::Context as _;
use serde::Deserialize;

use super::redis::RedisTarget;
use lanekeeper::controller::dataplane::{
    self, assignments, Applied, ShardChange, Sources, TierLoad, TierSource,
};
use lanekeeper::crd::{ShardSet, TierAssignmentsSpec};
use lanekeeper::store::SetId;

/// Largest YAML file `dataplane apply` reads.
const MAX_FILE_BYTES: u64 = 16 << 20;

#[derive(clap::Args, Debug)]
pub struct DataplaneArgs {
    #[command(subcommand)]
    command: DataplaneCommand,
}

#[derive(clap::Subcommand, Debug)]
enum DataplaneCommand {
    /// Write ShardSets' routing tables, queue policies, tiers and
    /// spec.tenants into Redis, as the controller does, without Kubernetes.
    ///
    /// Every document is checked before anything is written (kind,
    /// apiVersion, the controller's spec checks). Applying the same spec
    /// again changes nothing; a changed queue policy takes effect at the
    /// workers' next lease (the scripts read it from Redis). A changed
    /// spec.shards is refused (a reshard needs the controller). The set is
    /// <metadata.namespace or "default">/<metadata.name>: give workers and
    /// ingest the same --shard-set. The spec's delivery timeouts, backoffs
    /// and concurrency are the workers' own settings: the environment the
    /// controller would give them is printed.
    Apply(ApplyArgs),
}

#[derive(clap::Args, Debug)]
// The set comes from each document (--shard-set, if given, must agree) and
// the URL may come from spec.redis.url.
#[command(
    mut_arg("redis", |a| a.required(false)),
    mut_arg("shard_set", |a| a.required(false))
)]
struct ApplyArgs {
    /// ShardSet YAML: one document or several (`---`); `-` reads stdin.
    #[arg(long, short = 'f', value_name = "PATH")]
    file: PathBuf,
    /// The text of the tier ConfigMap a spec names in
    /// scheduler.tierAssignments (`<tenant> <tier>` lines, as the
    /// ConfigMap's key holds them); there is no Kubernetes to read it from.
    #[arg(long, value_name = "PATH")]
    tiers_file: Option<PathBuf>,
    /// What to print: `text`, or `json` (one object per set, in a list).
    #[arg(long, short = 'o', value_enum, default_value = "text")]
    output: Output,
    /// Where the sets' Redis is (`--redis` wins over spec.redis.url;
    /// --shard-set, if given, must name the document's set).
    #[command(flatten)]
    target: RedisTarget,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Output {
    Text,
    Json,
}

pub async fn run(args: DataplaneArgs) -> anyhow::Result<()> {
    match args.command {
        DataplaneCommand::Apply(args) => apply(args).await,
    }
}

/// One checked document, ready to apply.
struct Doc {
    set: ShardSet,
    id: SetId,
    url: String,
}

async fn apply(args: ApplyArgs) -> anyhow::Result<()> {
    let text = super::read_input(&args.file, MAX_FILE_BYTES)?;
    let sets = parse(&text).with_context(|| args.file.display().to_string())?;
    let tiers_text = args
        .tiers_file
        .as_deref()
        .map(|f| super::read_input(f, MAX_FILE_BYTES))
        .transpose()?;
    // Check everything before writing anything.
    let mut docs = Vec::new();
    for (i, set) in sets.into_iter().enumerate() {
        let doc = check(set, &args, tiers_text.as_deref())
            .with_context(|| format!("{}: document {}", args.file.display(), i + 1))?;
        docs.push(doc);
    }
    if docs.is_empty() {
        anyhow::bail!("{}: no ShardSet in it", args.file.display());
    }
    if let (Some(path), false) = (
        &args.tiers_file,
        docs.iter()
            .any(|d| d.set.spec.scheduler.tier_assignments.is_some()),
    ) {
        anyhow::bail!(
            "--tiers-file {} given, but no ShardSet sets spec.scheduler.tierAssignments; nothing was written",
            path.display()
        );
    }
    let source = FileTiers { text: tiers_text };
    let mut reports = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        let done = apply_one(doc, &args.target, &source).await;
        let applied = match done {
            Ok(a) => a,
            Err(e) => {
                let before: Vec<String> = docs[..i].iter().map(|d| d.id.to_string()).collect();
                let e = e.context(format!("ShardSet {}", doc.id));
                if before.is_empty() {
                    return Err(e);
                }
                return Err(e.context(format!("applied before the failure: {}", before.join(", "))));
            }
        };
        match args.output {
            Output::Text => print!("{}", text_report(doc, &applied)),
            Output::Json => reports.push(json_report(doc, &applied)),
        }
    }
    if args.output == Output::Json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    }
    Ok(())
}

/// The ShardSets of a YAML stream: each document must be one (empty
/// documents are skipped). Errors name the document and the field.
fn parse(text: &str) -> anyhow::Result<Vec<ShardSet>> {
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let n = i + 1;
        let value = serde_yaml::Value::deserialize(doc)
            .map_err(|e| anyhow::anyhow!("document {n}: not YAML: {e}"))?;
        if value.is_null() {
            continue;
        }
        let field = |k: &str| value.get(k).and_then(|v| v.as_str()).map(str::to_string);
        let want = format!("{}/{}", lanekeeper::crd::GROUP, lanekeeper::crd::VERSION);
        match (field("apiVersion"), field("kind")) {
            (Some(api), Some(kind)) if api == want && kind == "ShardSet" => {}
            (api, kind) => anyhow::bail!(
                "document {n}: apiVersion {} kind {}: only ShardSet ({want}) can be applied to a data plane",
                api.as_deref().unwrap_or("(missing)"),
                kind.as_deref().unwrap_or("(missing)")
            ),
        }
        // A field the ShardSet does not have is a typo to name, not to
        // drop: `kubectl apply --validate=strict` refuses it too.
        let mut unknown = Vec::new();
        let set: ShardSet = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
            value,
            // apiVersion and kind were checked above; the type does not keep them
            &mut |path: serde_ignored::Path| match path.to_string().as_str() {
                "apiVersion" | "kind" => {}
                other => unknown.push(other.to_string()),
            },
        ))
        .map_err(|e| {
            let path = e.path().to_string();
            anyhow::anyhow!("document {n}: {path}: {}", e.into_inner())
        })?;
        if !unknown.is_empty() {
            anyhow::bail!(
                "document {n}: unknown field{} {}: a ShardSet has no such field (misspelt?)",
                if unknown.len() == 1 { "" } else { "s" },
                unknown.join(", ")
            );
        }
        out.push(set);
    }
    Ok(out)
}

/// What a document needs beyond YAML: the controller's checks, a Redis to
/// write to, a set id, and the tier text when the spec names a ConfigMap.
fn check(mut set: ShardSet, args: &ApplyArgs, tiers: Option<&str>) -> anyhow::Result<Doc> {
    // Status is the controller's (and an old epoch in it would read as a
    // Redis that lost its state).
    set.status = None;
    dataplane::check_spec(&set)?;
    let ns = set
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = set.metadata.name.clone().unwrap_or_default();
    let id = SetId::new(&ns, &name);
    if let Some(given) = &args.target.shard_set {
        anyhow::ensure!(
            *given == id,
            "--shard-set (or LANEKEEPER_SHARD_SET) is {given}, but the document is ShardSet {id} (metadata.namespace/metadata.name); drop the flag or make them agree"
        );
    }
    let url = match (&args.target.redis, &set.spec.redis.url) {
        (Some(url), _) | (None, Some(url)) => url.clone(),
        (None, None) => anyhow::bail!(
            "spec.redis.urlSecretRef names a Secret, and there is no Kubernetes to read it from: give the URL with --redis (or LANEKEEPER_REDIS_URL)"
        ),
    };
    if let Some(tls) = &set.spec.redis.tls {
        if tls.ca_secret_ref.is_some() && args.target.redis_ca_file.is_none() {
            anyhow::bail!("spec.redis.tls.caSecretRef names a Secret, and there is no Kubernetes to read it from: give the CA with --redis-ca-file (or LANEKEEPER_REDIS_CA_FILE)");
        }
        if tls.client_cert_secret_ref.is_some() && args.target.redis_client_cert_file.is_none() {
            anyhow::bail!("spec.redis.tls.clientCertSecretRef names a Secret, and there is no Kubernetes to read it from: give --redis-client-cert-file and --redis-client-key-file");
        }
    }
    if let Some(spec) = &set.spec.scheduler.tier_assignments {
        let Some(text) = tiers else {
            anyhow::bail!(
                "spec.scheduler.tierAssignments names ConfigMap {:?}, and there is no Kubernetes to read it from: give its text (key {:?}) with --tiers-file, or remove the field",
                spec.config_map_name,
                spec.key
            );
        };
        assignments(spec, text)
            .map_err(|e| anyhow::anyhow!("--tiers-file: {e}; nothing was written"))?;
    }
    Ok(Doc { set, id, url })
}

async fn apply_one(doc: &Doc, target: &RedisTarget, tiers: &FileTiers) -> anyhow::Result<Applied> {
    let spec = &doc.set.spec.redis;
    let store = target
        .connect_with(
            &doc.url,
            doc.id.clone(),
            target.redis_cluster || spec.cluster,
            target
                .redis_username
                .as_deref()
                .or(spec.username.as_deref()),
        )
        .await?;
    let sources = Sources {
        lanes: &[],
        min_queues: 0,
        tiers,
        shard_change: ShardChange::Refuse,
    };
    Ok(dataplane::apply_spec(&doc.set, &store, sources).await?)
}

/// `--tiers-file`: the ConfigMap's text, recorded as
/// `<configMapName>/sha256:<first 16 hex digits>` so that applying the same
/// text again writes nothing.
struct FileTiers {
    text: Option<String>,
}

impl TierSource for FileTiers {
    async fn load(
        &self,
        _set: &ShardSet,
        spec: &TierAssignmentsSpec,
        synced: Option<&str>,
    ) -> TierLoad {
        use sha2::Digest;
        let Some(text) = &self.text else {
            // `check` refuses a spec with tierAssignments and no file.
            return TierLoad::Failed("no --tiers-file".into());
        };
        let digest = sha2::Sha256::digest(text.as_bytes());
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        let source = format!("{}/sha256:{hex}", spec.config_map_name);
        if synced == Some(source.as_str()) {
            return TierLoad::Unchanged;
        }
        TierLoad::Text {
            what: "file",
            source,
            text: text.clone(),
        }
    }
}

/// The environment the controller's shard Deployment gives each worker
/// (`controller::build`, the same builder), without what differs per
/// worker or holds a credential (Redis URL and password, set, queue, pod
/// name, metrics address, log format): the spec's delivery settings and
/// concurrency, which are the worker's flags, not Redis's.
fn worker_env(set: &ShardSet) -> Vec<(String, String)> {
    use lanekeeper::worker::env;
    let built = dataplane::standalone(set);
    let skip = [
        env::REDIS_URL,
        env::REDIS_PASSWORD,
        env::SHARD_SET,
        env::QUEUE,
        env::POD_NAME,
        env::METRICS_ADDR,
        env::LOG_FORMAT,
    ];
    let Ok(deployments) = lanekeeper::controller::build::shard_deployments_upto(&built, 0) else {
        return Vec::new();
    };
    deployments
        .first()
        .and_then(|d| {
            d.spec
                .as_ref()?
                .template
                .spec
                .as_ref()?
                .containers
                .first()?
                .env
                .clone()
        })
        .unwrap_or_default()
        .into_iter()
        .filter(|e| !skip.contains(&e.name.as_str()))
        .filter_map(|e| Some((e.name, e.value?)))
        .collect()
}

fn routing_word(a: &Applied) -> &'static str {
    if a.created {
        "created"
    } else if a.rewritten {
        "restored (its epoch mark was missing)"
    } else {
        "unchanged"
    }
}

fn text_report(doc: &Doc, a: &Applied) -> String {
    let mut out = format!(
        "ShardSet {} ({})\n",
        doc.id,
        lanekeeper::store::redact(&doc.url)
    );
    let durability = match a.table.replicated {
        None => "Fast".to_string(),
        Some(d) => format!("Replicated, replica wait {d:?}"),
    };
    out += &format!(
        "  routing table: {}; {} shards, epoch {}, durability {durability}{}\n",
        routing_word(a),
        a.table.shards,
        a.epoch,
        if a.durability_changed && !a.rewritten {
            " (changed)"
        } else {
            ""
        }
    );
    out += &format!(
        "  queue policies: written for {} shard queues (shard-00 to {})\n",
        a.queues,
        lanekeeper::routing::QueueId::Shard(a.queues.saturating_sub(1))
    );
    match &a.tiers {
        None => out += "  tier assignments (scheduler.tierAssignments): not set\n",
        Some(t) => {
            out += &format!(
                "  tier assignments: {} tenants, synced from {}\n",
                t.tenants,
                t.synced.as_deref().unwrap_or("-")
            );
            if let Some(m) = &t.message {
                out += &format!("    problem: {m}\n");
            }
        }
    }
    match &a.overrides {
        None => out += "  spec.tenants: none\n",
        Some(o) => {
            out += &format!(
                "  spec.tenants: {} entries; held paused: {}\n",
                o.tenants,
                if o.paused.is_empty() {
                    "none".to_string()
                } else {
                    o.paused.join(", ")
                }
            );
            if let Some(m) = &o.message {
                out += &format!("    problem: {m}\n");
            }
        }
    }
    let env: Vec<String> = worker_env(&doc.set)
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    out += &format!(
        "  workers: one per shard queue, with the environment the controller gives them:\n    {} lanekeeper worker --redis URL --shard-set {} --queue shard-NN\n",
        env.join(" "),
        doc.id
    );
    for n in &a.notes {
        out += &format!(
            "  {}{}: {}\n",
            if n.warning { "warning: " } else { "" },
            n.reason,
            n.message
        );
    }
    out
}

fn json_report(doc: &Doc, a: &Applied) -> serde_json::Value {
    serde_json::json!({
        "shardSet": doc.id.to_string(),
        "redis": lanekeeper::store::redact(&doc.url),
        "routing": {
            "action": if a.created { "created" } else if a.rewritten { "restored" } else { "unchanged" },
            "shards": a.table.shards,
            "version": a.table.version,
            "epoch": a.epoch,
            "replicatedMs": a.table.replicated.map(|d| d.as_millis() as u64),
            "durabilityChanged": a.durability_changed,
        },
        "queuePolicies": a.queues,
        "workerEnv": worker_env(&doc.set).into_iter().collect::<std::collections::BTreeMap<_, _>>(),
        "tierAssignments": a.tiers,
        "tenantOverrides": a.overrides,
        "notes": a.notes.iter().map(|n| serde_json::json!({
            "warning": n.warning,
            "reason": n.reason,
            "message": n.message,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SET: &str = "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata:\n  name: hooks\nspec:\n  shards: 2\n  redis:\n    url: redis://127.0.0.1:6379\n  worker:\n    image: w:1\n";

    #[test]
    fn several_documents_and_empty_ones() {
        let text = format!("---\n{SET}---\n---\n{}", SET.replace("hooks", "other"));
        let sets = parse(&text).unwrap();
        let names: Vec<_> = sets
            .iter()
            .map(|s| s.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["hooks", "other"]);
    }

    #[test]
    fn another_kind_or_version_is_refused_by_name() {
        let e = parse(&SET.replace("kind: ShardSet", "kind: Deployment")).unwrap_err();
        assert!(
            e.to_string()
                .contains("document 1: apiVersion lanekeeper.io/v1alpha1 kind Deployment"),
            "{e}"
        );
        let e = parse(&SET.replace("v1alpha1", "v1")).unwrap_err();
        assert!(
            e.to_string()
                .contains("apiVersion lanekeeper.io/v1 kind ShardSet"),
            "{e}"
        );
        let e = parse("kind: ShardSet\n").unwrap_err();
        assert!(e.to_string().contains("apiVersion (missing)"), "{e}");
    }

    #[test]
    fn a_missing_or_bad_field_is_named_with_its_path() {
        let e = parse(&SET.replace("    image: w:1\n", "    replicas: 1\n")).unwrap_err();
        assert!(e.to_string().contains("document 1: spec.worker"), "{e}");
        assert!(e.to_string().contains("image"), "{e}");
        let e = parse(&SET.replace("shards: 2", "shards: two")).unwrap_err();
        assert!(e.to_string().contains("spec.shards"), "{e}");
    }
}
