//! One module per subcommand.

pub mod bench;
pub mod decode;
pub mod demo;
pub mod embed;
pub mod forward;
pub mod info;
pub mod recall;
