//! `lanekeeper ingest-key`: make a new API key for ingest.

use lanekeeper::ingest::auth;

#[derive(clap::Args, Debug)]
pub struct IngestKeyArgs {
    /// Name of the key, for logs.
    #[arg(long)]
    name: String,
    /// The tenant the key may act for.
    #[arg(long, conflicts_with = "admin", required_unless_present = "admin")]
    tenant: Option<String>,
    /// The key may act for every tenant.
    #[arg(long)]
    admin: bool,
    /// How to print the key and its entry: text for a person; json or yaml
    /// (`{key, entry}`, the entry as the api keys file lists it) for a script.
    #[arg(long, short, value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Text,
    Json,
    Yaml,
}

/// What `--output json|yaml` prints.
#[derive(serde::Serialize)]
struct Made<'a> {
    /// The key: give it to the producer; it is stored nowhere.
    key: &'a str,
    /// The entry to add under `keys:` in the api keys file.
    entry: auth::KeyEntry,
}

pub fn run(args: IngestKeyArgs) -> anyhow::Result<()> {
    if let Some(t) = &args.tenant {
        lanekeeper::envelope::validate_tenant(t)?;
    }
    let key = auth::generate_key();
    let entry = auth::KeyEntry {
        name: args.name,
        sha256: auth::hash_key_hex(&key),
        tenant: args.tenant.filter(|_| !args.admin),
        admin: args.admin,
    };
    match args.output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&Made { key: &key, entry })?
        ),
        Output::Yaml => print!("{}", serde_yaml::to_string(&Made { key: &key, entry })?),
        Output::Text => {
            println!("key (give it to the producer; it is not stored anywhere): {key}");
            println!("entry for the api keys file:");
            let scope = match &entry.tenant {
                Some(t) => format!("tenant: {}", serde_json::to_string(t)?),
                None => "admin: true".to_string(),
            };
            println!(
                "  - {{name: {}, sha256: {}, {scope}}}",
                serde_json::to_string(&entry.name)?,
                entry.sha256
            );
        }
    }
    Ok(())
}
