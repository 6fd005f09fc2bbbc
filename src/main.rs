use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// lanekeeper keeps one tenant's flood of webhooks from delaying everyone else's.
///
/// One binary runs every part: the Kubernetes operator, the delivery workers,
/// the ingest API and the tools around them.
#[derive(Parser, Debug)]
#[command(name = "lanekeeper", version, about, long_about)]
struct Cli {
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
    Crds {
        /// Directory to write one file per CRD into, instead of stdout.
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Crds { out } => crds(out),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lanekeeper: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn crds(out: Option<PathBuf>) -> anyhow::Result<()> {
    use anyhow::Context;
    match out {
        None => print!("{}", lanekeeper::crd::all_yaml()?),
        Some(dir) => {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating output directory {}", dir.display()))?;
            for crd in lanekeeper::crd::all() {
                let path = dir.join(lanekeeper::crd::file_name(&crd));
                std::fs::write(&path, lanekeeper::crd::to_yaml(&crd)?)
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
        }
    }
    Ok(())
}
