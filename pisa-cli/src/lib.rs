//! Library half of the `pisa` command line: tensor file IO ([`io`]), input loading
//! ([`input`]) and the argument groups shared by commands ([`args`]). Split from the binary so
//! the file parsers can be fuzzed and tested on their own.

pub mod args;
pub mod input;
pub mod io;
pub mod limits;
pub mod text;
