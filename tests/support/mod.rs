//! Test support: real servers started on free loopback ports for the life of
//! one test binary. Each test binary compiles this module on its own and uses
//! only part of it.
#![allow(dead_code)]

pub mod controlplane;
pub mod dataplane;
pub mod demo;
pub mod integrity;
pub mod lanes;
pub mod model;
pub mod process;
pub mod receiver;
pub mod redis;
pub mod reshard;
pub mod scenario;
pub mod workers;
