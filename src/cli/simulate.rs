//! `lanekeeper simulate`: its flags live with the simulator
//! (`lanekeeper::simulate::SimulateArgs`); this runs it until it is done or
//! until the shutdown, which deletes the run's keys.

use lanekeeper::simulate::SimulateArgs;

use super::shutdown::Shutdown;

pub async fn run(args: SimulateArgs, shutdown: Shutdown) -> anyhow::Result<()> {
    lanekeeper::simulate::run_cli(args, shutdown.wait()).await
}
