//! `lanekeeper`: the table of contents of the binary. Each subcommand's
//! flags and run function are in `cli/<subcommand>.rs`; this file lists
//! them and dispatches.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// lanekeeper keeps one tenant's flood of webhooks from delaying everyone else's.
///
/// One binary runs every part: the Kubernetes operator, the delivery workers,
/// the ingest API and the tools around them.
#[derive(Parser, Debug)]
#[command(name = "lanekeeper", version, about, long_about)]
struct Cli {
    /// Log format (logs go to stderr; RUST_LOG filters).
    #[arg(
        long,
        global = true,
        env = lanekeeper::worker::env::LOG_FORMAT,
        value_enum,
        default_value = "text"
    )]
    log_format: lanekeeper::telemetry::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the ShardSet and DedicatedLane CustomResourceDefinitions as YAML.
    ///
    /// Without --out, both CRDs go to stdout as one multi-document stream, ready
    /// for `lanekeeper crds | kubectl apply -f -`. With --out DIR, each CRD is
    /// written to DIR/<name>.yaml, as committed in the repository's crds/.
    Crds(cli::crds::CrdsArgs),

    /// Print the queue each tenant routes to.
    ///
    /// With --shards, the rendezvous hash alone (no Redis needed). With
    /// --redis and --shard-set, the set's live routing table, pins included.
    Route(cli::route::RouteArgs),

    /// Deliver the webhooks of one queue (what every shard and lane pod runs).
    ///
    /// Leases envelopes fairly, POSTs them signed (Standard Webhooks) to the
    /// tenant's endpoint, and acks, retries with backoff, or dead-letters.
    /// SIGTERM stops leasing, lets deliveries in flight finish within the
    /// grace period and gives back the rest; SIGKILL loses nothing either.
    Worker(Box<cli::worker::WorkerArgs>),

    /// Run the operator: ShardSets become worker Deployments, routing in
    /// Redis, and status. Uses the in-cluster identity or $KUBECONFIG.
    Controller(Box<cli::controller::ControllerArgs>),

    /// Serve the ingest API: producers post events over HTTP.
    ///
    /// Events are validated, routed and enqueued (following MOVED answers,
    /// held while their tenant moves); endpoints, dead letters and tenant
    /// stats are managed under /v1/tenants/{tenant}. The OpenAPI document is
    /// at /v1/openapi.json; /metrics, /healthz and /readyz share the port.
    /// SIGTERM stops accepting and lets requests in flight finish.
    Ingest(Box<cli::ingest::IngestArgs>),

    /// Make a new API key for ingest: prints the key (give it to the
    /// producer, once) and the entry for the api keys file (its SHA-256 only).
    IngestKey(cli::ingest_key::IngestKeyArgs),

    /// Show which tenants own each queue's backlog and capacity.
    ///
    /// For every queue of a ShardSet: tenant, outstanding depth, its share of
    /// the queue's depth, and its share of the queue's worker-seconds over the
    /// window (capacity %), largest consumers first.
    Top(cli::top::TopArgs),

    /// Assign tenants' tiers in bulk from a file, or show one tenant's tier.
    ///
    /// `tiers apply --file tiers.txt` takes `<tenant> <tier>` lines (`-`
    /// clears), all or nothing, as the ingest admin API's bulk call does;
    /// `tiers get TENANT` prints the tier in force and where it comes from.
    Tiers(cli::tiers::TiersArgs),

    /// Act on one tenant in an incident: pause, resume, show.
    ///
    /// `tenant pause TENANT` stops its deliveries (ingest keeps accepting,
    /// within its backlog limit; a move keeps it paused), `tenant resume
    /// TENANT` restarts them in order, `tenant show TENANT` prints where it
    /// lives, what it holds and its latest audit entries. Each change is
    /// recorded in the set's audit trail, as the ingest admin API's are.
    Tenant(cli::tenant::TenantArgs),

    /// Run the data plane without Kubernetes: `dataplane apply -f
    /// shardset.yaml --redis URL` writes what the controller writes into
    /// Redis for a ShardSet (routing table, queue policies, tiers,
    /// spec.tenants), by the same code, so that `worker` and `ingest` run
    /// on a laptop, in CI or on VMs.
    Dataplane(cli::dataplane::DataplaneArgs),

    /// Compare FIFO, hashed shards, fair scheduling and dedicated lanes on a
    /// tenant mix, before touching production (needs --redis).
    ///
    /// Replays one generated workload (small tenants with power-law volumes,
    /// whale imports, log-normal endpoint latencies) through each strategy,
    /// running the production Lua scripts on the Redis given with --redis
    /// under a virtual clock, in a throwaway ShardSet whose keys it deletes.
    /// Prints small-tenant wait p50/p95/p99, whale drain time and shard skew
    /// per strategy, and writes an SVG chart of small-tenant wait over time.
    Simulate(Box<lanekeeper::simulate::SimulateArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    lanekeeper::telemetry::init_logging(cli.log_format);
    let result = match cli.command {
        Command::Crds(args) => cli::crds::run(args),
        Command::Route(args) => cli::block_on(cli::route::run(args)),
        Command::Top(args) => cli::block_on(cli::top::run(args)),
        Command::Tiers(args) => cli::block_on(cli::tiers::run(args)),
        Command::Tenant(args) => cli::block_on(cli::tenant::run(args)),
        Command::Dataplane(args) => cli::block_on(cli::dataplane::run(args)),
        Command::IngestKey(args) => cli::ingest_key::run(args),
        Command::Worker(args) => cli::serve(|stop| cli::worker::run(*args, stop)),
        Command::Ingest(args) => cli::serve(|stop| cli::ingest::run(*args, stop)),
        Command::Controller(args) => cli::serve(|stop| cli::controller::run(*args, stop)),
        Command::Simulate(args) => cli::serve(|stop| cli::simulate::run(*args, stop)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lanekeeper: {err:#}");
            ExitCode::FAILURE
        }
    }
}
