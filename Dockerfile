# One image runs every lanekeeper subcommand (crds today; controller, worker
# and ingest as they land). Base images are pinned by exact tag.
FROM rust:1.95.0-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
RUN cargo build --release --locked --bin lanekeeper

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/lanekeeper /usr/local/bin/lanekeeper
# distroless "nonroot" is UID/GID 65532; nothing is written to the root FS.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/lanekeeper"]
