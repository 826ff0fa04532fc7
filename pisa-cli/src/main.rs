//! The `pisa` command line.
mod io;

fn main() {
    println!("pisa {}", env!("CARGO_PKG_VERSION"));
}
