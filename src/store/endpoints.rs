//! The endpoint registry: a tenant's named endpoints, stored as JSON in one
//! hash per tenant.

use std::collections::BTreeMap;

use super::{keys, Result, Store, StoreError};
use crate::endpoint::Endpoint;

impl Store {
    fn endpoints_key(&self, tenant: &str) -> String {
        keys::endpoints(&self.set, tenant)
    }

    /// Create or replace a tenant's endpoint.
    pub async fn put_endpoint(&self, tenant: &str, name: &str, endpoint: &Endpoint) -> Result<()> {
        crate::envelope::validate_tenant(tenant)?;
        endpoint.validate().map_err(StoreError::InvalidEndpoint)?;
        let json = serde_json::to_string(endpoint).map_err(|e| StoreError::Protocol {
            script: "endpoint registry",
            detail: e.to_string(),
        })?;
        let mut conn = self.conn.clone();
        redis::cmd("HSET")
            .arg(self.endpoints_key(tenant))
            .arg(name)
            .arg(json)
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// One endpoint of a tenant, if registered.
    pub async fn endpoint(&self, tenant: &str, name: &str) -> Result<Option<Endpoint>> {
        let mut conn = self.conn.clone();
        let raw: Option<String> = redis::cmd("HGET")
            .arg(self.endpoints_key(tenant))
            .arg(name)
            .query_async(&mut conn)
            .await?;
        raw.map(|r| decode_endpoint(tenant, name, &r)).transpose()
    }

    /// Every endpoint of a tenant, by name.
    pub async fn endpoints(&self, tenant: &str) -> Result<BTreeMap<String, Endpoint>> {
        let mut conn = self.conn.clone();
        let raw: BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(self.endpoints_key(tenant))
            .query_async(&mut conn)
            .await?;
        raw.iter()
            .map(|(name, r)| Ok((name.clone(), decode_endpoint(tenant, name, r)?)))
            .collect()
    }

    /// Remove a tenant's endpoint; false if there was none.
    pub async fn delete_endpoint(&self, tenant: &str, name: &str) -> Result<bool> {
        let mut conn = self.conn.clone();
        let n: u32 = redis::cmd("HDEL")
            .arg(self.endpoints_key(tenant))
            .arg(name)
            .query_async(&mut conn)
            .await?;
        Ok(n > 0)
    }
}

fn decode_endpoint(tenant: &str, name: &str, raw: &str) -> Result<Endpoint> {
    serde_json::from_str(raw).map_err(|e| StoreError::Protocol {
        script: "endpoint registry",
        detail: format!("endpoint {name} of {tenant}: {e}"),
    })
}
