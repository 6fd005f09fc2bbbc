//! The throwaway Redis of a test binary is real and isolated.

mod support;

#[tokio::test]
async fn test_redis_is_a_real_server() {
    let redis = support::redis::shared();
    let client = redis::Client::open(redis.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(pong, "PONG");
    let _: () = redis::cmd("SET")
        .arg("lk:test")
        .arg("1")
        .query_async(&mut conn)
        .await
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(info.contains(&format!("tcp_port:{}", redis.port)), "{info}");
    // Lua scripting works: the data plane depends on it.
    let n: i64 = redis::Script::new("return redis.call('INCR', KEYS[1])")
        .key("lk:test")
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 2);
}
