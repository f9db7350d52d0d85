use std::process::ExitCode;

use clap::Parser;

use baton::config::{Cli, Command, LeaderCommand};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let role_log = match &cli.command {
        Command::Serve(s) => s.role_log.clone(),
        _ => None,
    };
    if let Err(e) = baton::logging::init(cli.log_format, &cli.log, role_log.as_deref()) {
        eprintln!("error: cannot set up logging: {e}");
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let result: anyhow::Result<()> = rt.block_on(async {
        match cli.command {
            Command::Serve(args) => Ok(baton::server::run(args).await?),
            Command::Dev(args) => baton::devcluster::run_dev(args).await,
            Command::Leader { command } => match command {
                LeaderCommand::Get(args) => baton::cli::leader_get(&args).await,
                LeaderCommand::Resign(args) => baton::cli::leader_resign(&args).await,
            },
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
