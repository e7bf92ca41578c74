//! The `memvisor-testkit` command: the hostile clients, run against a live server for a while
//! (the real-guest trials' `--after-fuzz` attack the server before QEMU connects to it). Each
//! prints one line of what it did; the server must answer or hang up, never crash, and serve
//! a well-behaved peer afterwards, which the trial checks.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "memvisor-testkit",
    version,
    about = "memvisor's test kit: hostile clients for its servers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Act as a hostile vhost-user frontend: send malformed messages to a back end for a while
    #[command(name = "vhost-user-fuzz")]
    VhostUserFuzz(FuzzArgs),
    /// Act as a hostile vfio-user client: send malformed and well-formed messages to a server
    /// for a while, reconnecting whenever it hangs up
    #[command(name = "vfio-user-fuzz")]
    VfioUserFuzz(FuzzArgs),
}

#[derive(Args)]
struct FuzzArgs {
    /// Socket of the back end or server to attack
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// How long to keep at it
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Seed of the message generator (the same seed sends the same messages)
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::VhostUserFuzz(args) => run_fuzz(&args),
        Command::VfioUserFuzz(args) => run_vfio_user_fuzz(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_fuzz(args: &FuzzArgs) -> Result<()> {
    let stats = memvisor_testkit::vhost::fuzz::run(
        &args.socket,
        args.seed,
        Duration::from_secs(args.seconds),
    )
    .with_context(|| format!("fuzzing the back end at {}", args.socket.display()))?;
    println!(
        "vhost-user-fuzz: {} connections, {} messages, {} replies ({} refusals), {} hang-ups",
        stats.connections, stats.messages, stats.replies, stats.refusals, stats.hangups
    );
    Ok(())
}

fn run_vfio_user_fuzz(args: &FuzzArgs) -> Result<()> {
    let s = memvisor_testkit::vfio_user::fuzz::run(
        &args.socket,
        args.seed,
        Duration::from_secs(args.seconds),
    )
    .with_context(|| format!("fuzzing the vfio-user server at {}", args.socket.display()))?;
    println!(
        "vfio-user-fuzz (seed {}): {} connections, {} messages, {} replies ({} refusals), {} \
         hang-ups, {} abandoned, {} tables started, {} DMA_READ/DMA_WRITE answered",
        args.seed,
        s.connections,
        s.messages,
        s.replies,
        s.refusals,
        s.hangups,
        s.abandoned,
        s.tables,
        s.server_requests
    );
    Ok(())
}
