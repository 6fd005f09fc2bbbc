//! Error paths the real API server does not produce on demand, against a
//! `tower-test` mock that asserts each request the reconciler makes.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::Client;
use tower_test::mock::{self, Handle};

use super::*;
use crate::controller::build::BuildError;

fn set(shards: i32) -> ShardSet {
    let mut s: ShardSet = serde_yaml::from_str(&format!(
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: hooks, namespace: prod, uid: uid-1, generation: 3}}
spec:
  shards: {shards}
  redis: {{url: "redis://127.0.0.1:1/"}}
  worker: {{image: "lanekeeper:1"}}
"#
    ))
    .unwrap();
    s.metadata.resource_version = Some("1".into());
    // Carries its finalizer already (adding it is one more request).
    s.metadata.finalizers = Some(vec![FINALIZER.to_string()]);
    s
}

pub(crate) fn api_error(code: StatusCode, reason: &str) -> Response<Body> {
    let status = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": format!("mock says {reason}"), "reason": reason, "code": code.as_u16(),
    });
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(&status).unwrap()))
        .unwrap()
}

pub(crate) fn ctx() -> (Arc<Context>, Handle<Request<Body>, Response<Body>>) {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(svc, "default");
    (Arc::new(Context::new(client, Default::default())), handle)
}

/// Answer the next request, checking its method and path.
pub(crate) async fn expect(
    handle: &mut Handle<Request<Body>, Response<Body>>,
    method: Method,
    path_end: &str,
    response: Response<Body>,
) {
    let (req, send) = handle
        .next_request()
        .await
        .expect("the reconciler should make another request");
    assert_eq!(req.method(), method, "{}", req.uri());
    assert!(
        req.uri().path().ends_with(path_end),
        "expected …{path_end}, got {}",
        req.uri()
    );
    send.send_response(response);
}

/// The condition of type `type_` in a status patch.
pub(crate) fn condition_in(patch: &serde_json::Value, type_: &str) -> serde_json::Value {
    let conditions = patch["status"]["conditions"].as_array().unwrap();
    let found = conditions.iter().find(|c| c["type"] == type_);
    found
        .unwrap_or_else(|| panic!("no {type_} in {patch}"))
        .clone()
}

/// The reconcile error metric counts one error of `kind`.
pub(crate) fn counted_once(ctx: &Context, controller: &str, kind: &str) {
    let text = crate::telemetry::Encode::encode(&ctx.metrics);
    let line = format!(
        "lanekeeper_reconcile_errors_total{{controller=\"{controller}\",kind=\"{kind}\"}} 1"
    );
    assert!(text.contains(&line), "{text}");
}

/// Answer the lists a reconcile starts with (shard Deployments, lanes): none.
async fn expect_empty_lists(handle: &mut Handle<Request<Body>, Response<Body>>) {
    for (path_end, kind) in [
        ("/namespaces/prod/deployments", "DeploymentList"),
        ("/namespaces/prod/dedicatedlanes", "DedicatedLaneList"),
    ] {
        let list = serde_json::json!({
            "kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": [],
        });
        expect(
            handle,
            Method::GET,
            path_end,
            Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&list).unwrap()))
                .unwrap(),
        )
        .await;
    }
}

#[tokio::test]
async fn conflict_on_apply_is_retried_with_growing_backoff() {
    let (ctx, mut handle) = ctx();
    let set = Arc::new(set(2));
    for attempt in 1..=3u32 {
        let server = {
            let mut handle_ref = std::mem::replace(&mut handle, mock::pair().1);
            tokio::spawn(async move {
                expect_empty_lists(&mut handle_ref).await;
                expect(
                    &mut handle_ref,
                    Method::PATCH,
                    "/namespaces/prod/deployments/hooks-shard-00",
                    api_error(StatusCode::CONFLICT, "Conflict"),
                )
                .await;
                handle_ref
            })
        };
        let err = reconcile(set.clone(), ctx.clone()).await.unwrap_err();
        handle = server.await.unwrap();
        assert!(matches!(err, Error::Kube(_)), "{err}");
        let action = error_policy(set.clone(), &err, ctx.clone());
        assert_eq!(
            action,
            Action::requeue(Duration::from_secs(2u64.pow(attempt)))
        );
    }
}

#[tokio::test]
async fn server_errors_are_transient_not_fatal() {
    let (ctx, mut handle) = ctx();
    let set = Arc::new(set(1));
    let server = tokio::spawn(async move {
        expect_empty_lists(&mut handle).await;
        expect(
            &mut handle,
            Method::PATCH,
            "/deployments/hooks-shard-00",
            api_error(StatusCode::INTERNAL_SERVER_ERROR, "InternalError"),
        )
        .await;
    });
    let err = reconcile(set.clone(), ctx.clone()).await.unwrap_err();
    server.await.unwrap();
    assert!(err.to_string().contains("mock says InternalError"), "{err}");
    assert_eq!(
        error_policy(set, &err, ctx.clone()),
        Action::requeue(Duration::from_secs(2))
    );
    counted_once(&ctx, "shardset", "kube");
}

#[tokio::test]
async fn an_unservable_spec_is_degraded_and_waits_for_a_change() {
    let (ctx, mut handle) = ctx();
    // Out of range: the CRD's CEL rule forbids it, but an old object or a
    // disabled webhook can still hand one to the controller.
    let set = Arc::new(set(0));
    let server = tokio::spawn(async move {
        // First the Event for Degraded=True, then the status.
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.method(), Method::POST);
        assert!(
            req.uri().path().ends_with("/namespaces/prod/events"),
            "{}",
            req.uri()
        );
        let event = http_body_util::BodyExt::collect(req.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert!(String::from_utf8_lossy(&event).contains("InvalidSpec"));
        send.send_response(
            Response::builder()
                .status(201)
                .body(Body::from(event.to_vec()))
                .unwrap(),
        );
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.method(), Method::PATCH);
        assert!(
            req.uri().path().ends_with("/shardsets/hooks/status"),
            "{}",
            req.uri()
        );
        let body = http_body_util::BodyExt::collect(req.into_body())
            .await
            .unwrap()
            .to_bytes();
        let patch: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let degraded = condition_in(&patch, "Degraded");
        assert_eq!(degraded["status"], "True");
        assert_eq!(degraded["reason"], "InvalidSpec");
        assert_eq!(patch["status"]["observedGeneration"], 3);
        let mut stored = serde_json::to_value(self::set(0)).unwrap();
        stored["status"] = patch["status"].clone();
        send.send_response(
            Response::builder()
                .status(200)
                .body(Body::from(serde_json::to_vec(&stored).unwrap()))
                .unwrap(),
        );
    });
    let err = reconcile(set.clone(), ctx.clone()).await.unwrap_err();
    server.await.unwrap();
    assert!(matches!(err, Error::Build(BuildError::Shards(0))), "{err}");
    assert_eq!(error_policy(set, &err, ctx), Action::await_change());
}

#[tokio::test]
async fn an_undecodable_object_is_reported_and_does_not_stall_the_watch() {
    let (ctx, _handle) = ctx();
    // What an older or newer schema might leave in etcd: no spec.worker.
    let raw = r#"{"apiVersion":"lanekeeper.io/v1alpha1","kind":"ShardSet",
        "metadata":{"name":"odd","namespace":"prod"},"spec":{"shards":2,"redis":{"url":"redis://r:6379"}}}"#;
    let obj: DeserializeGuard<ShardSet> = serde_json::from_str(raw).unwrap();
    assert!(obj.0.is_err());
    let obj = Arc::new(obj);
    let err = reconcile_guarded(obj.clone(), ctx.clone())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("cannot decode ShardSet prod/odd"),
        "{err}"
    );
    assert!(err.to_string().contains("worker"), "{err}");
    assert_eq!(error_policy_guarded(obj, &err, ctx), Action::await_change());
}
