//! Lane reconciles against a `tower-test` mock that asserts each request
//! (the ApiServerVerifier style of `controller::mock_tests`): the paths that
//! end before any Redis is needed, a scenario per test.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kube::runtime::controller::Action;
use tower_test::mock::Handle;

use super::super::shardset::mock_tests::{api_error, condition_in, counted_once, ctx, expect};
use super::*;

type Server = Handle<Request<Body>, Response<Body>>;

const LANES: &str = "/apis/lanekeeper.io/v1alpha1/namespaces/prod/dedicatedlanes";
const SETS: &str = "/apis/lanekeeper.io/v1alpha1/namespaces/prod/shardsets";

/// A DedicatedLane `whale` of set `hooks`, with its finalizer.
fn lane() -> DedicatedLane {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "lanekeeper.io/v1alpha1",
        "kind": "DedicatedLane",
        "metadata": {"name": "whale", "namespace": "prod", "uid": "uid-l", "generation": 2,
            "resourceVersion": "7", "finalizers": [FINALIZER]},
        "spec": {"shardSet": "hooks", "tenant": "whale"},
        "status": {"phase": "Pending"},
    }))
    .unwrap()
}

fn json(value: &impl serde::Serialize) -> Response<Body> {
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(value).unwrap()))
        .unwrap()
}

/// The body of the next request, after checking its method and path; the
/// mock answers `answer`.
async fn body_of(
    handle: &mut Server,
    method: Method,
    path: &str,
    answer: Response<Body>,
) -> serde_json::Value {
    let (req, send) = handle.next_request().await.expect("another request");
    assert_eq!((req.method(), req.uri().path()), (&method, path));
    let body = http_body_util::BodyExt::collect(req.into_body())
        .await
        .unwrap()
        .to_bytes();
    send.send_response(answer);
    serde_json::from_slice(&body).unwrap()
}

/// The reconcile reads the lane fresh (not from its cache): answer `lane`.
async fn fresh_read(handle: &mut Server, lane: &DedicatedLane) {
    expect(handle, Method::GET, "/dedicatedlanes/whale", json(lane)).await;
}

/// The lane is read fresh, its set is not found, and the next request
/// patches `LANES` + `path`: its body (answered with `lane`).
async fn without_its_set(
    handle: &mut Server,
    lane: &DedicatedLane,
    path: &str,
) -> serde_json::Value {
    fresh_read(handle, lane).await;
    let gone = api_error(StatusCode::NOT_FOUND, "NotFound");
    expect(handle, Method::GET, "/shardsets/hooks", gone).await;
    let path = format!("{LANES}{path}");
    body_of(handle, Method::PATCH, &path, json(lane)).await
}

async fn run(lane: DedicatedLane, ctx: Arc<Context>) -> Result<Action, LaneError> {
    tokio::time::timeout(Duration::from_secs(10), reconcile(&lane, &ctx))
        .await
        .expect("the reconcile made a request nobody answers")
}

#[tokio::test]
async fn a_lane_whose_set_does_not_exist_fails_and_says_why() {
    let (ctx, mut handle) = ctx();
    let server = tokio::spawn(async move {
        let patch = without_its_set(&mut handle, &lane(), "/whale/status").await;
        assert_eq!(patch["status"]["phase"], "Failed");
        let admitted = condition_in(&patch, "Admitted");
        assert_eq!(
            (&admitted["status"], &admitted["reason"]),
            (&"False".into(), &"ShardSetNotFound".into())
        );
        assert!(admitted["message"].as_str().unwrap().contains("hooks"));
    });
    let action = run(lane(), ctx).await.unwrap();
    server.await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(30)));
}

#[tokio::test]
async fn a_deleted_lane_whose_set_is_gone_drops_its_finalizer() {
    let (ctx, mut handle) = ctx();
    let mut deleted = lane();
    deleted.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
    );
    let fresh = deleted.clone();
    let server = tokio::spawn(async move {
        let patch = without_its_set(&mut handle, &fresh, "/whale").await;
        assert_eq!(patch["metadata"]["finalizers"], serde_json::json!([]));
    });
    let action = run(deleted, ctx).await.unwrap();
    server.await.unwrap();
    assert_eq!(action, Action::await_change());
}

#[tokio::test]
async fn a_lane_of_a_set_being_deleted_is_left_alone() {
    let (ctx, mut handle) = ctx();
    let set: ShardSet = serde_json::from_value(serde_json::json!({
        "apiVersion": "lanekeeper.io/v1alpha1",
        "kind": "ShardSet",
        "metadata": {"name": "hooks", "namespace": "prod", "uid": "uid-1",
            "deletionTimestamp": "2026-01-01T00:00:00Z", "finalizers": ["x"]},
        "spec": {"shards": 2, "redis": {"url": "redis://127.0.0.1:1/"},
            "worker": {"image": "lanekeeper:1"}},
    }))
    .unwrap();
    let server = tokio::spawn(async move {
        fresh_read(&mut handle, &lane()).await;
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.uri().path(), format!("{SETS}/hooks"));
        send.send_response(json(&set));
        // Nothing else: no owner reference added back, no Redis, no status.
        handle
    });
    let action = run(lane(), ctx).await.unwrap();
    let _handle = server.await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(5)));
}

#[tokio::test]
async fn an_api_error_is_counted_as_the_lanes_and_retried() {
    let (ctx, mut handle) = ctx();
    let server = tokio::spawn(async move {
        let broken = api_error(StatusCode::INTERNAL_SERVER_ERROR, "InternalError");
        expect(&mut handle, Method::GET, "/dedicatedlanes/whale", broken).await;
    });
    let err = run(lane(), ctx.clone()).await.unwrap_err();
    server.await.unwrap();
    assert!(matches!(err, LaneError::Kube(_)), "{err}");
    let obj = Arc::new(DeserializeGuard(Ok(lane())));
    assert_eq!(
        error_policy(obj, &err, ctx.clone()),
        Action::requeue(Duration::from_secs(2))
    );
    counted_once(&ctx, "dedicatedlane", "kube");
}
