# syntax=docker/dockerfile:1.7
#
# One image runs every lanekeeper subcommand: `controller`, `worker`,
# `ingest`, `crds`, `route`, `top`. The chart and config/default pass the
# subcommand as the container's args; the entrypoint is the binary.
#
# Base images are pinned by exact tag and digest. To move to a newer base,
# change both together (the digest is what a build actually pulls):
#   crane digest rust:<version>-slim-bookworm
#   crane digest gcr.io/distroless/cc-debian12:nonroot
#
# Build:  docker build -t lanekeeper:dev .
# Lint:   hadolint Dockerfile   (.ci/run does this)

############################
# build: a release binary, exactly the dependency versions of Cargo.lock
############################
FROM rust:1.95.0-slim-bookworm@sha256:d7482085ff5b415f84dba5647ae71606650bdef00db7aeb69f4b3d170c3e4082 AS build
WORKDIR /src
# Only what the binary is built from, plus benches/: Cargo.toml declares the
# bench targets and cargo refuses a manifest whose targets are missing. A
# change to tests, charts or docs does not invalidate these layers.
COPY Cargo.toml Cargo.lock ./
COPY benches ./benches
COPY src ./src
# The cache mounts keep the registry and the target dir between builds
# (BuildKit); the binary is copied out of the cached target dir.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin lanekeeper \
    && install -D -m 0755 target/release/lanekeeper /out/lanekeeper

############################
# runtime: glibc + CA certificates, no shell, no package manager
############################
FROM gcr.io/distroless/cc-debian12:nonroot@sha256:9dac0a79194e45a7da0158a9c6da57b217585af0786db3845d1f0ec1a0dd182f
LABEL org.opencontainers.image.title="lanekeeper" \
      org.opencontainers.image.description="Kubernetes operator and webhook-delivery data plane: controller, worker and ingest in one binary" \
      org.opencontainers.image.licenses="Apache-2.0"
# Owned by root and not writable by the runtime user: the binary cannot be replaced.
COPY --from=build --chown=0:0 --chmod=0755 /out/lanekeeper /usr/local/bin/lanekeeper
# A fixed numeric UID/GID (distroless "nonroot", 65532), so that
# runAsNonRoot can verify it without an /etc/passwd lookup. The process
# writes nothing to the filesystem: it runs with readOnlyRootFilesystem.
USER 65532:65532
# Controller metrics/health port; the worker and ingest take theirs from flags.
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/lanekeeper"]
CMD ["--help"]
