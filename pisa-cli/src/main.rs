//! The `pisa` command line.
fn main() {
    println!("pisa {}", env!("CARGO_PKG_VERSION"));
}
