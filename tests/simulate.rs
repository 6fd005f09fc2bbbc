//! The capacity simulator against a real `redis-server`: the strategies rank
//! as the seeds predict on a small mix, the scripts really ran on the virtual
//! clock, the binary prints the table and writes the chart, and no key is
//! left behind.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use lanekeeper::envelope::Envelope;
use lanekeeper::routing::QueueId;
use lanekeeper::simulate::{self, Latency, Mix, Promotion, Strategy, Whale, Workload};
use lanekeeper::store::{LeaseOutcome, SetId, Store};

/// Keys left under `lk:{simulate/<prefix>*`.
fn leftover_keys(url: &str, prefix: &str) -> Vec<String> {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_connection().unwrap();
    redis::cmd("KEYS")
        .arg(lanekeeper::store::keys::sets_pattern("simulate", prefix))
        .query(&mut conn)
        .unwrap()
}

/// Four shards of two workers (about 125 deliveries/s in all, 31 per
/// shard, at a 50 ms median latency), 100 small tenants sending 15/s for
/// 40 s, and a whale pushing 3,000 envelopes at 150/s from 2 s: faster than
/// the whole pool, so a single FIFO queue backs up for everyone, and five
/// times what its own shard can take. Promotion looks every second over a
/// 10 s window and promotes after 4 s hot, so the whale gets its lane
/// while its import is still arriving.
fn small_mix() -> Mix {
    Mix {
        seed: 7,
        duration: Duration::from_secs(40).into(),
        tenants: 100,
        rate: 15.0,
        zipf: 1.0,
        latency: Latency::default(),
        whales: vec![Whale {
            tenant: "whale".into(),
            count: 3000,
            start: Duration::from_secs(2).into(),
            rate: 150.0,
            latency: None,
        }],
        shards: 4,
        workers: 2,
        cap: 8,
        quantum_seconds: 2.0,
        promotion: Promotion {
            promote_after: Duration::from_secs(4).into(),
            window: Duration::from_secs(10).into(),
            tick: Duration::from_secs(1).into(),
            ..Promotion::default()
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strategies_rank_as_the_seeds_predict() {
    let redis = support::redis::shared();
    let mix = small_mix();
    let workload = Workload::generate(&mix);
    let started = Instant::now();
    let report = simulate::run(&redis.url, &mix, &workload).await.unwrap();
    let wall = started.elapsed();
    println!("{}", simulate::table(&report));

    let fifo = report.get(Strategy::Fifo);
    let sharded = report.get(Strategy::ShardsFifo);
    let fair = report.get(Strategy::ShardsFair);
    let lanes = report.get(Strategy::FairLanes);
    for r in &report.results {
        assert_eq!(
            r.deliveries as usize,
            workload.arrivals.len(),
            "{:?} delivered everything",
            r.strategy
        );
        assert_eq!(
            r.small.count,
            workload
                .arrivals
                .iter()
                .filter(|a| workload.small[a.tenant as usize])
                .count()
        );
    }

    // One FIFO queue: the whale's backlog is everyone's. Hashed shards confine
    // it to one shard of four, so far fewer small envelopes wait: the share
    // delayed over 1 s drops by at least 3x (the shard count is 4; the
    // tenants sharing the whale's shard wait longer, hence the margin), and
    // the median small envelope no longer waits at all.
    assert!(
        fifo.small.delayed_share >= 3.0 * sharded.small.delayed_share,
        "delayed share: fifo {:.3} vs shards-fifo {:.3}",
        fifo.small.delayed_share,
        sharded.small.delayed_share
    );
    assert!(fifo.small.p50 >= 1.0, "fifo p50 {}", fifo.small.p50);
    assert!(
        sharded.small.p50 <= 0.1,
        "shards-fifo p50 {}",
        sharded.small.p50
    );
    // ...but hashing moves the pain rather than shrinking it (the seed: the
    // tenants on the whale's shard "experience exactly the same wait as
    // before"): with a quarter of the small traffic on the whale's shard, the
    // p99 lands among them, and their shard has a quarter of the workers.
    assert!(
        sharded.small.p99 >= fifo.small.p99,
        "p99: shards-fifo {} vs fifo {}",
        sharded.small.p99,
        fifo.small.p99
    );

    // Fair scheduling: a small tenant's wait no longer depends on the whale's
    // backlog. The hashed-FIFO p99 is tens of seconds, the fair one a few
    // deliveries' time; require 10x, far inside the measured gap.
    assert!(
        sharded.small.p99 >= 10.0 * fair.small.p99,
        "p99: shards-fifo {} vs shards-fair {}",
        sharded.small.p99,
        fair.small.p99
    );
    assert!(fair.small.p99 < 1.0, "fair p99 {}", fair.small.p99);

    // Dedicated lanes: at or below fair (10% + 5 ms of tolerance), the whale
    // was promoted by the production rule, and its lane drained it sooner.
    assert!(
        lanes.small.p99 <= fair.small.p99 * 1.1 + 0.005,
        "p99: fair+lanes {} vs shards-fair {}",
        lanes.small.p99,
        fair.small.p99
    );
    assert_eq!(
        lanes
            .promoted
            .iter()
            .map(|(t, _)| t.as_str())
            .collect::<Vec<_>>(),
        vec!["whale"]
    );
    let (fair_drain, lanes_drain) = (
        fair.max_whale_drain().unwrap(),
        lanes.max_whale_drain().unwrap(),
    );
    assert!(
        lanes_drain <= 0.9 * fair_drain,
        "whale drain: lanes {lanes_drain} vs fair {fair_drain}"
    );
    assert!(
        lanes.skew < fair.skew,
        "lane took the whale's work off its shard"
    );

    // Fairness must not waste capacity: the whale drains under fair
    // scheduling within 1.2x of FIFO on the same shards. (The single FIFO
    // queue lets the whale use all four shards' workers, so its drain there
    // measures sharding, not fairness: it is reported, not compared.)
    let sharded_drain = sharded.max_whale_drain().unwrap();
    assert!(
        fair_drain <= 1.2 * sharded_drain,
        "whale drain: fair {fair_drain} vs shards-fifo {sharded_drain}"
    );
    // skew: one queue is 1; hashed shards with a whale are lopsided
    assert_eq!(fifo.skew, 1.0);
    assert!(sharded.skew > 2.0, "skew {}", sharded.skew);

    // The fair strategies ran on the virtual clock: minutes of virtual time
    // in seconds of wall time (each lease was also checked, in the
    // simulator, to carry its envelope's virtual arrival time).
    assert!(fair.makespan > 60.0, "virtual makespan {}", fair.makespan);
    assert!(wall.as_secs_f64() < fair.makespan, "wall {wall:?}");

    // The chart: SVG, one polyline per strategy.
    let svg = simulate::svg(&report);
    assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<polyline").count(), 4);
    assert_eq!(svg.matches("</polyline>").count(), 4);
    assert_text_fits(&svg);
    for s in Strategy::ALL {
        assert!(
            svg.contains(&format!("<title>{}</title>", s.name())),
            "{}",
            s.name()
        );
    }

    // Nothing left in Redis.
    let mine = format!("sim-{}-", std::process::id());
    assert_eq!(leftover_keys(&redis.url, &mine), Vec::<String>::new());
}

/// The strategies, and the queues of each, run side by side: the report
/// must not depend on how they interleave. Two runs of one seed agree on
/// everything but wall time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_gives_the_same_report() {
    let redis = support::redis::shared();
    let mut mix = small_mix();
    mix.duration = Duration::from_secs(15).into();
    mix.whales[0].count = 1200;
    mix.promotion.promote_after = Duration::from_secs(2).into();
    let workload = Workload::generate(&mix);
    let a = simulate::run(&redis.url, &mix, &workload).await.unwrap();
    let b = simulate::run(&redis.url, &mix, &workload).await.unwrap();
    for (x, y) in a.results.iter().zip(&b.results) {
        assert_eq!(x.strategy, y.strategy);
        assert_eq!(x.small, y.small, "{:?}", x.strategy);
        assert_eq!(x.whale_drain, y.whale_drain, "{:?}", x.strategy);
        assert_eq!(x.series, y.series, "{:?}", x.strategy);
        assert_eq!(x.promoted, y.promoted, "{:?}", x.strategy);
        assert_eq!(x.makespan, y.makespan, "{:?}", x.strategy);
        assert_eq!(x.deliveries, y.deliveries, "{:?}", x.strategy);
        assert!(
            x.skew == y.skew || (x.skew.is_infinite() && y.skew.is_infinite()),
            "{:?}",
            x.strategy
        );
    }
    assert!(
        !a.get(Strategy::FairLanes).promoted.is_empty(),
        "the lanes strategy promoted, so the tick barrier was crossed"
    );
}

#[tokio::test]
async fn the_virtual_clock_drives_the_scripts() {
    let redis = support::redis::shared();
    let store = Store::connect(
        &redis.url,
        SetId::new("simulate", "clock-test"),
        Default::default(),
    )
    .await
    .unwrap();
    let q = QueueId::Shard(0);
    let at = 1_600_000_000_000u64;
    store.set_virtual_clock(q, at).await.unwrap();
    let env = Envelope {
        id: "e1".into(),
        tenant: "a".into(),
        endpoint: None,
        event_type: None,
        payload: serde_json::json!({}),
    };
    store.enqueue(q, &env).await.unwrap();
    store.set_virtual_clock(q, at + 5_000).await.unwrap();
    let LeaseOutcome::Leased(lease) = store.lease(q, "w", Duration::from_secs(30)).await.unwrap()
    else {
        panic!("nothing leased")
    };
    assert_eq!(lease.enqueued_ms, at);
    assert_eq!(lease.deadline_ms, at + 5_000 + 30_000);

    // the lease expires when the virtual clock passes its deadline: reaped
    store.set_virtual_clock(q, at + 40_000).await.unwrap();
    assert_eq!(store.maintain(q, 10).await.unwrap(), (0, 1));

    // cleared: Redis time again
    store.clear_virtual_clock(q).await.unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let LeaseOutcome::Leased(again) = store.lease(q, "w", Duration::from_secs(30)).await.unwrap()
    else {
        panic!("the reaped envelope is leased again")
    };
    assert!(
        again.deadline_ms.abs_diff(now + 30_000) < 5_000,
        "{} vs {now}",
        again.deadline_ms
    );

    assert!(store.purge_set().await.unwrap() > 0);
    assert_eq!(
        leftover_keys(&redis.url, "clock-test"),
        Vec::<String>::new()
    );
}

#[test]
fn the_binary_prints_the_table_and_writes_the_chart() {
    let redis = support::redis::shared();
    let exe = env!("CARGO_BIN_EXE_lanekeeper");

    let help = Command::new(exe)
        .args(["simulate", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("--redis <URL>") && help.contains("required"),
        "{help}"
    );
    let missing = Command::new(exe)
        .args(["simulate"])
        .env_remove("LANEKEEPER_REDIS_URL")
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("--redis"));

    // the sample mix, shrunk by flags so it runs in a few seconds
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("chart.svg");
    let mix = concat!(env!("CARGO_MANIFEST_DIR"), "/config/simulate/mix.yaml");
    let child = Command::new(exe)
        .args(["simulate", "--redis", &redis.url, "--mix", mix])
        .args([
            "--duration",
            "10s",
            "--tenants",
            "30",
            "--rate",
            "10",
            "--shards",
            "2",
        ])
        .args([
            "--whale",
            "big:300:1s:100",
            "--promote-after",
            "2s",
            "--promotion-window",
            "10s",
        ])
        .args(["--promotion-tick", "1s", "--svg"])
        .arg(&chart)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{stdout}");
    assert!(
        stdout.contains("small p50") && stdout.contains("whale drain") && stdout.contains("skew")
    );
    for s in Strategy::ALL {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("{} ", s.name()))),
            "a row for {}: {stdout}",
            s.name()
        );
    }
    assert!(stdout.contains(&format!("chart: {}", chart.display())));
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg"));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<polyline").count(), 4);
    assert_eq!(
        leftover_keys(&redis.url, &format!("sim-{pid}-")),
        Vec::<String>::new()
    );
}

#[test]
fn an_interrupted_run_deletes_its_keys() {
    let redis = support::redis::shared();
    let exe = env!("CARGO_BIN_EXE_lanekeeper");
    let dir = tempfile::tempdir().unwrap();
    let mix = concat!(env!("CARGO_MANIFEST_DIR"), "/config/simulate/mix.yaml");
    // the full sample mix: minutes in a debug build, so it is mid-run when stopped
    let child = Command::new(exe)
        .args(["simulate", "--redis", &redis.url, "--mix", mix, "--svg"])
        .arg(dir.path().join("chart.svg"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let prefix = format!("sim-{pid}-");
    let deadline = Instant::now() + Duration::from_secs(60);
    while leftover_keys(&redis.url, &prefix).is_empty() {
        assert!(Instant::now() < deadline, "the run never wrote to Redis");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(1));
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("interrupted; deleted the run's"),
        "{stderr}"
    );
    assert_eq!(leftover_keys(&redis.url, &prefix), Vec::<String>::new());
}

/// Issue 21, item 4: promotion on the trend, on the seeds' import story.
/// The same workload twice through `fair+lanes`, once on the share alone
/// (hot for `promoteAfter`, 15 s) and once with `projectedWait` (10 s):
/// the import's backlog at its drain rate passes 10 s within a tick or two
/// of its start, so its lane comes that much sooner, the import leaves
/// its shard sooner, and the small tenants' p99 is no worse for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn projected_wait_gets_the_import_its_lane_before_the_backlog_builds() {
    let redis = support::redis::shared();
    let mut mix = small_mix();
    mix.promotion.promote_after = Duration::from_secs(15).into();
    let workload = Workload::generate(&mix);
    // run ids of their own: the other tests look for what runs named
    // `sim-<pid>-` leave behind while these may still be running
    let id = |what: &str| format!("trend-{what}-{}", std::process::id());
    let share_only = simulate::run_as(&redis.url, &mix, &workload, &id("share"))
        .await
        .unwrap();
    let mut trend_mix = mix.clone();
    trend_mix.promotion.projected_wait = Some(Duration::from_secs(10).into());
    let on_trend = simulate::run_as(&redis.url, &trend_mix, &workload, &id("on"))
        .await
        .unwrap();
    assert_eq!(leftover_keys(&redis.url, "trend-"), Vec::<String>::new());
    println!("share only:\n{}", simulate::table(&share_only));
    println!("with projectedWait 10s:\n{}", simulate::table(&on_trend));
    let start = 2.0;
    let lane_at = |r: &simulate::Report| {
        r.get(Strategy::FairLanes)
            .promoted
            .iter()
            .find(|(t, _)| t == "whale")
            .map(|(_, at)| at - start)
            .expect("the whale got a lane")
    };
    let (before, after) = (lane_at(&share_only), lane_at(&on_trend));
    let p99 = |r: &simulate::Report| r.get(Strategy::FairLanes).small.p99;
    let drain = |r: &simulate::Report| r.get(Strategy::FairLanes).max_whale_drain().unwrap();
    println!(
        "RESULT import_to_lane_share_s={before:.1} import_to_lane_trend_s={after:.1} \
         small_p99_share_ms={:.0} small_p99_trend_ms={:.0} whale_drain_share_s={:.1} whale_drain_trend_s={:.1}",
        p99(&share_only) * 1000.0,
        p99(&on_trend) * 1000.0,
        drain(&share_only),
        drain(&on_trend),
    );
    // the share path needs promoteAfter (15 s) of hot on top of the time
    // the share takes to build; the trend needs a tick or two
    assert!(before >= 15.0, "share-only lane {before} s after the start");
    assert!(after <= 5.0, "trend lane {after} s after the start");
    // The import leaves its shard sooner: the shard's worker-seconds are
    // no longer the whale's (skew falls). (Its own drain can be longer: a
    // late lane drains the import on the lane and on its shard at once.)
    let skew = |r: &simulate::Report| r.get(Strategy::FairLanes).skew;
    assert!(
        skew(&on_trend) < skew(&share_only),
        "skew: trend {} vs share {}",
        skew(&on_trend),
        skew(&share_only)
    );
    assert!(
        p99(&on_trend) <= p99(&share_only) * 1.5 + 0.05,
        "small p99: trend {} vs share {}",
        p99(&on_trend),
        p99(&share_only)
    );
}

/// Every left-anchored text of the chart ends inside it, at 7.5 px a glyph
/// (wider than 12 px sans-serif's average): the legend is not cut off.
fn assert_text_fits(svg: &str) {
    let attr = |tag: &str, name: &str| -> f64 {
        let at = tag.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        tag[at..].split('"').next().unwrap().parse().unwrap()
    };
    let width = attr(svg.lines().next().unwrap(), "width");
    let mut legend = 0;
    for piece in svg.split("<text").skip(1) {
        let (tag, rest) = piece.split_once('>').unwrap();
        let text = rest.split("</text>").next().unwrap();
        if tag.contains("text-anchor") {
            continue;
        }
        legend += usize::from(text.contains("(p99") && !text.contains("of each"));
        let end = attr(tag, "x") + text.chars().count() as f64 * 7.5;
        assert!(end <= width, "{text:?} ends at {end} px of {width}");
    }
    assert_eq!(legend, 4, "one legend entry per strategy");
}
