//! What an execution leaves behind on disk (defined with the guard, which writes it; see
//! [`baton_guard::record`]).

pub use baton_guard::record::*;
