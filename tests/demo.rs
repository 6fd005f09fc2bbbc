//! The demo's smoke test: the README's main command, shortened, end to end
//! (control plane, Redis, controller, workers, ingest, receiver). It fails
//! when the import is not delivered or the small tenants' p95 wait is over
//! its bound.

mod support;

#[path = "../examples/demo/scenario.rs"]
mod scenario;

use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shortened_demo_delivers_the_import_and_keeps_the_resets_fast() {
    let chart = support::process::scratch_dir("demo").join("shops-wait.svg");
    let cfg = scenario::Config {
        import: 6_000,
        import_pace: Duration::from_millis(200),
        small_tenants: 6,
        reset_every: Duration::from_millis(200),
        give_up: Duration::from_secs(180),
        chart: chart.clone(),
    };
    let s = scenario::run(cfg).await;
    assert_eq!(s.whale_delivered, 6_000, "{s:?}");
    assert!(s.resets_posted > 0, "{s:?}");
    assert_eq!(s.bad_signatures, 0, "{s:?}");
    // Generous for a loaded 2-core CI machine; the full demo shows a few ms.
    let (p50, p95, _) = s.shops_wait;
    assert!(
        p95 <= 1_000,
        "the password resets' p95 wait was {p95} ms (p50 {p50} ms)"
    );
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline"),
        "{svg}"
    );
}
