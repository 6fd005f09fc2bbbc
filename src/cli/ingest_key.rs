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
}

pub fn run(args: IngestKeyArgs) -> anyhow::Result<()> {
    let (name, tenant, admin) = (args.name.as_str(), args.tenant.as_deref(), args.admin);
    if let Some(t) = tenant {
        lanekeeper::envelope::validate_tenant(t)?;
    }
    let key = auth::generate_key();
    println!("key (give it to the producer; it is not stored anywhere): {key}");
    println!("entry for the api keys file:");
    let scope = match tenant {
        Some(t) if !admin => format!("tenant: {}", serde_json::to_string(t)?),
        _ => "admin: true".to_string(),
    };
    println!(
        "  - {{name: {}, sha256: {}, {scope}}}",
        serde_json::to_string(name)?,
        auth::hash_key_hex(&key)
    );
    Ok(())
}
