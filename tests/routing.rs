//! Rendezvous routing: stable across processes, minimal movement on resize,
//! and the live table in Redis (`lanekeeper route`, `lanekeeper top`).

mod support;

use std::process::{Command, Stdio};

use lanekeeper::routing::{hash_shard, QueueId};

fn tenants(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("tenant-{i:06}")).collect()
}

/// Run `lanekeeper <args>`, assert it succeeded, and return its stdout.
fn lanekeeper(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_lanekeeper"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "lanekeeper {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn route_in_child(shards: u16, tenants: &[String]) -> Vec<String> {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_lanekeeper"))
        .args(["route", "--shards", &shards.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = tenants.join("\n");
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

#[test]
fn same_tenant_same_shard_in_separate_processes() {
    let ts = tenants(2000);
    let a = route_in_child(32, &ts);
    let b = route_in_child(32, &ts);
    assert_eq!(a.len(), 2000);
    assert_eq!(a, b, "two processes disagree");
    for (line, t) in a.iter().zip(&ts) {
        assert_eq!(
            line,
            &format!("{t}\t{}", hash_shard(t, 32)),
            "child and this process disagree"
        );
    }
}

#[test]
fn growing_n_to_n_plus_1_moves_about_one_in_n_plus_1() {
    let ts = tenants(100_000);
    for n in [4u16, 32] {
        let before: Vec<QueueId> = ts.iter().map(|t| hash_shard(t, n)).collect();
        let after: Vec<QueueId> = ts.iter().map(|t| hash_shard(t, n + 1)).collect();
        let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
        let expected = ts.len() as f64 / (n as f64 + 1.0);
        let ratio = moved as f64 / expected;
        eprintln!("{n} -> {} shards: {moved} of 100000 tenants moved (expected {expected:.0}, ratio {ratio:.3})", n + 1);
        assert!(
            (0.8..=1.2).contains(&ratio),
            "{n}->{}: moved {moved}, expected about {expected:.0}",
            n + 1
        );
        // Every mover lands on the new shard: nobody shuffles between old ones.
        assert!(before
            .iter()
            .zip(&after)
            .filter(|(b, a)| b != a)
            .all(|(_, a)| *a == QueueId::Shard(n)));
    }
}

#[test]
fn spread_of_40000_tenants_on_32_shards() {
    let mut counts = [0u32; 32];
    for t in tenants(40_000) {
        if let QueueId::Shard(s) = hash_shard(&t, 32) {
            counts[s as usize] += 1;
        }
    }
    let mut sorted = counts.to_vec();
    sorted.sort();
    let median = (sorted[15] + sorted[16]) as f64 / 2.0;
    let spread = sorted[31] as f64 / median;
    eprintln!(
        "40000 tenants on 32 shards: min {} median {median} max {}; max/median {spread:.3}",
        sorted[0], sorted[31]
    );
    assert!(spread < 1.15, "max/median tenants per shard {spread:.3}");
}

#[tokio::test]
async fn live_table_pins_and_version() {
    use lanekeeper::store::{SetId, Store};
    let redis = support::redis::shared();
    let s = Store::connect(
        &redis.url,
        SetId::new("routing", "live"),
        Default::default(),
    )
    .await
    .unwrap();
    let v1 = s.set_shards(8).await.unwrap();
    assert_eq!(
        s.set_shards(8).await.unwrap(),
        v1,
        "no change, no version bump"
    );
    let v2 = s.pin("whale", QueueId::Lane(2)).await.unwrap();
    assert!(v2 > v1);
    let table = s.routing().await.unwrap();
    assert_eq!(table.shards, 8);
    assert_eq!(table.route("whale"), QueueId::Lane(2));
    assert_eq!(table.route("minnow"), hash_shard("minnow", 8));

    let out = lanekeeper(&[
        "route",
        "--redis",
        &redis.url,
        "--shard-set",
        "routing/live",
        "whale",
        "minnow",
    ]);
    assert_eq!(
        out,
        format!("whale\tlane-2\nminnow\t{}\n", hash_shard("minnow", 8))
    );

    let v3 = s.unpin("whale").await.unwrap();
    assert!(v3 > v2);
    assert_eq!(
        s.routing().await.unwrap().route("whale"),
        hash_shard("whale", 8)
    );
}

#[tokio::test]
async fn top_prints_depth_and_capacity_shares() {
    use lanekeeper::envelope::Envelope;
    use lanekeeper::producer::Producer;
    use lanekeeper::store::{LeaseOutcome, SetId, Store};
    use std::time::Duration;
    let redis = support::redis::shared();
    let s = Store::connect(&redis.url, SetId::new("routing", "top"), Default::default())
        .await
        .unwrap();
    s.set_shards(1).await.unwrap();
    let p = Producer::new(s.clone(), Duration::from_secs(1));
    for (tenant, n) in [("bigimport", 30u32), ("reset", 3)] {
        for i in 0..n {
            let e = Envelope {
                id: format!("{tenant}-{i}"),
                tenant: tenant.into(),
                endpoint: None,
                event_type: None,
                payload: serde_json::json!({}),
            };
            p.send(&e).await.unwrap();
        }
    }
    for _ in 0..6 {
        if let LeaseOutcome::Leased(l) = s
            .lease(QueueId::Shard(0), "w", Duration::from_secs(30))
            .await
            .unwrap()
        {
            let took = if l.tenant == "bigimport" { 3.0 } else { 1.0 };
            s.ack(&l, Duration::from_secs_f64(took)).await.unwrap();
        }
    }
    let text = lanekeeper(&["top", "--redis", &redis.url, "--shard-set", "routing/top"]);
    eprintln!("{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].split_whitespace().eq([
        "QUEUE",
        "TENANT",
        "DEPTH",
        "DEPTH%",
        "CAPACITY%",
        "STATE"
    ]));
    let big: Vec<&str> = lines
        .iter()
        .find(|l| l.contains("bigimport"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(big[0], "shard-00");
    let reset: Vec<&str> = lines
        .iter()
        .find(|l| l.contains("reset"))
        .unwrap()
        .split_whitespace()
        .collect();
    let depth = |row: &[&str]| row[2].parse::<u64>().unwrap();
    assert_eq!(depth(&big) + depth(&reset), 33 - 6);
    let pct = |s: &str| s.trim_end_matches('%').parse::<f64>().unwrap();
    assert!((pct(big[3]) + pct(reset[3]) - 100.0).abs() < 0.2);
    assert!((pct(big[4]) + pct(reset[4]) - 100.0).abs() < 0.2);
    assert!(
        pct(big[4]) > pct(reset[4]),
        "the import's endpoint is slower: it owns more capacity"
    );
    assert_eq!(big.len(), 5, "nobody is paused yet: {big:?}");

    // A user's pause shows in top (even past --limit), in show, and in the
    // audit trail; a resume clears it.
    let target = ["--redis", redis.url.as_str(), "--shard-set", "routing/top"];
    let args = |cmd: &[&'static str], extra: &[&str]| -> Vec<String> {
        cmd.iter()
            .map(|s| s.to_string())
            .chain(target.iter().map(|s| s.to_string()))
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    let run = |v: Vec<String>| lanekeeper(&v.iter().map(String::as_str).collect::<Vec<_>>());
    let said = run(args(
        &["tenant", "pause"],
        &["reset", "--reason", "customer endpoint down"],
    ));
    assert!(said.starts_with("reset: paused in shard-00"), "{said}");
    let said = run(args(&["tenant", "pause"], &["reset"]));
    assert!(said.starts_with("reset: already paused"), "{said}");
    let text = run(args(&["top"], &["--limit", "1"]));
    eprintln!("{text}");
    let row = text.lines().find(|l| l.contains("reset")).unwrap();
    assert!(row.trim_end().ends_with("paused"), "{row}");
    let shown: serde_json::Value =
        serde_json::from_str(&run(args(&["tenant", "show"], &["reset", "-o", "json"]))).unwrap();
    assert_eq!(shown["paused"], true);
    assert_eq!(shown["queue"], "shard-00");
    assert_eq!(shown["audit"][0]["operation"], "pause");
    assert!(shown["audit"][0]["who"]
        .as_str()
        .unwrap()
        .starts_with("cli:"));
    let outcome = shown["audit"][1]["outcome"].as_str().unwrap();
    assert!(
        outcome.contains("reason: customer endpoint down"),
        "{outcome}"
    );
    let said = run(args(&["tenant", "resume"], &["reset"]));
    assert!(said.starts_with("reset: resumed in shard-00"), "{said}");
    let text = run(args(&["top"], &[]));
    let row = text.lines().find(|l| l.contains("reset")).unwrap();
    assert!(!row.contains("paused"), "{row}");
}

/// Every command that reads a ShardSet's queues says in its usage that it
/// needs --redis and --shard-set, and refuses to start without them, naming
/// both; `route` needs them only without --shards.
#[test]
fn commands_that_need_redis_say_so_in_their_usage() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_lanekeeper"))
            .args(args)
            .env_remove("LANEKEEPER_REDIS_URL")
            .env_remove("LANEKEEPER_SHARD_SET")
            .output()
            .unwrap()
    };
    let usage = |help: &str| {
        help.lines()
            .find(|l| l.starts_with("Usage:"))
            .unwrap_or_default()
            .to_string()
    };
    for cmd in [
        &["worker"][..],
        &["ingest"],
        &["top"],
        &["tenant", "pause"],
        &["tenant", "resume"],
        &["tenant", "show"],
        &["tiers", "apply"],
        &["tiers", "get"],
    ] {
        let help = run(&[cmd, &["--help"]].concat());
        let help = usage(&String::from_utf8_lossy(&help.stdout));
        assert!(
            help.contains("--redis <REDIS> --shard-set <SHARD_SET>") && !help.contains("[--redis"),
            "{cmd:?}: {help}"
        );
        let bare = run(cmd);
        let err = String::from_utf8_lossy(&bare.stderr);
        assert!(
            !bare.status.success()
                && err.contains("--redis <REDIS>")
                && err.contains("--shard-set <SHARD_SET>"),
            "{cmd:?} without --redis: {err}"
        );
    }
    let route = run(&["route", "--help"]);
    let help = usage(&String::from_utf8_lossy(&route.stdout));
    assert!(!help.contains("--redis"), "route: {help}");
    assert_eq!(
        lanekeeper(&["route", "--shards", "4", "acme"]).trim(),
        "acme\tshard-02"
    );
    let bare = run(&["route", "acme"]);
    let err = String::from_utf8_lossy(&bare.stderr);
    assert!(
        !bare.status.success() && err.contains("--redis <REDIS>"),
        "{err}"
    );
}
