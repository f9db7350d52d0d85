//! `baton-guard`: the lease guard of every job (see the `baton-guard` crate in `guard/`).

fn main() {
    std::process::exit(baton_guard::main(std::env::args_os().skip(1)));
}
