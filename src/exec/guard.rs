//! The guard's side of the worker: which program runs it, and the protocol both speak (see
//! [`baton_guard`], the program itself, in `guard/`).

pub use baton_guard::{Spec, GUARD_FAILED, NOT_STARTED, PROTOCOL};
