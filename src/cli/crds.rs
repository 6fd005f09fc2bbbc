//! `lanekeeper crds`: print or write the CustomResourceDefinitions.

use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Args, Debug)]
pub struct CrdsArgs {
    /// Directory to write one file per CRD into, instead of stdout.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

pub fn run(args: CrdsArgs) -> anyhow::Result<()> {
    match args.out {
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
