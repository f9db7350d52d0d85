//! Time on `CLOCK_BOOTTIME` (defined with the guard, which needs it too; see
//! [`baton_guard::clock`]).

pub use baton_guard::clock::*;
