use std::process::ExitCode;

use clap::Parser;

use baton::config::{Cli, Command, JobCommand, LeaderCommand, ScheduleCommand, WorkerCommand};

fn main() -> ExitCode {
    // The legacy guard (`--guard legacy`): the guard's code run by the whole binary, before
    // any argument parsing, runtime or logging.
    if std::env::args_os().nth(1).is_some_and(|a| a == "__guard") {
        return ExitCode::from(baton_guard::main(std::env::args_os().skip(2)) as u8);
    }
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
            Command::Serve(args) => Ok(baton::server::run(*args).await?),
            Command::Worker(args) => match &args.command {
                Some(WorkerCommand::List(c)) => baton::cli::workers::list(c).await,
                Some(WorkerCommand::Drain(a)) => baton::cli::workers::drain(a, true).await,
                Some(WorkerCommand::Undrain(a)) => baton::cli::workers::drain(a, false).await,
                None => Ok(baton::server::run_worker(*args).await?),
            },
            Command::Dev(args) => baton::devcluster::run_dev(args).await,
            Command::Leader { command } => match command {
                LeaderCommand::Get(args) => baton::cli::leader_get(&args).await,
                LeaderCommand::Resign(args) => baton::cli::leader_resign(&args).await,
                LeaderCommand::History(args) => baton::cli::leader_history(&args).await,
            },
            Command::Job { command } => match command {
                JobCommand::Submit(args) => baton::cli::jobs::submit(&args).await,
                JobCommand::Get(args) => baton::cli::jobs::get(&args).await,
                JobCommand::List(args) => baton::cli::jobs::list(&args).await,
                JobCommand::Cancel(args) => baton::cli::jobs::cancel(&args).await,
                JobCommand::Wait(args) => baton::cli::jobs::wait(&args).await,
                JobCommand::Logs(args) => baton::cli::jobs::logs(&args).await,
                JobCommand::Cleanup(args) => baton::cli::jobs::cleanup(&args).await,
            },
            Command::Schedule { command } => {
                use baton::cli::schedules as s;
                match command {
                    ScheduleCommand::Create(a) => s::create(&a).await,
                    ScheduleCommand::Get(a) => s::get(&a).await,
                    ScheduleCommand::List(a) => s::list(&a).await,
                    ScheduleCommand::Update(a) => s::update(&a).await,
                    ScheduleCommand::Pause(a) => s::pause(&a).await,
                    ScheduleCommand::Resume(a) => s::resume(&a).await,
                    ScheduleCommand::Delete(a) => s::delete(&a).await,
                    ScheduleCommand::Trigger(a) => s::trigger(&a).await,
                    ScheduleCommand::Backfill(a) => s::backfill(&a).await,
                }
            }
            Command::Drill(args) => {
                let code = baton::drill::run(*args).await?;
                if code != 0 {
                    return Err(baton::cli::jobs::JobExit(code as u8).into());
                }
                Ok(())
            }
            Command::Bench(args) => baton::bench::run(*args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<baton::cli::jobs::JobExit>().is_some() => {
            let code = e
                .downcast_ref::<baton::cli::jobs::JobExit>()
                .map_or(1, |j| j.0);
            ExitCode::from(code)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
