//! `./demo.sh` (or `cargo run --release --example demo` after building the
//! `lanekeeper` binary): the whole system on one machine, playing the story
//! lanekeeper exists for. The scenario lives beside this file
//! (`scenario.rs`), shared with the demo's smoke test (`tests/demo.rs`).
//!
//! Then one tenant imports 200,000 records through ingest while a dozen
//! others send password resets; the terminal shows per-shard depth, lanes,
//! the phase of any relocation and the resets' wait, once a second, and the
//! run ends with a summary table and an SVG chart. Ctrl-C stops it; every
//! process it started goes with it.

#[path = "../../tests/support/mod.rs"]
mod support;

mod scenario;

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    // Ctrl-C: exit, so the atexit hook and PDEATHSIG take every child down.
    rt.spawn(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\ninterrupted: stopping everything this demo started");
            support::process::stop_all();
            std::process::exit(130);
        }
    });
    let cfg = scenario::Config::default();
    let want = cfg.import;
    let summary = rt.block_on(scenario::run(cfg));
    support::process::stop_all();
    if summary.whale_delivered < want {
        eprintln!("the import was not delivered in time");
        std::process::exit(1);
    }
}
