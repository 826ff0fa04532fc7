//! Fuzzes the `.safetensors` reader of `pisa_cli::io` with arbitrary bytes: header (names and
//! metadata), then every tensor it names through the float and index readers, plus a name that
//! is not there. Contract: never panics; on success numel == product(shape) and the decoded
//! data is no larger than the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pisa_cli::io::{
    parse_index_tensor_bytes, parse_safetensors_header_bytes, parse_tensor_bytes, Format,
};

fuzz_target!(|data: &[u8]| {
    let names = match parse_safetensors_header_bytes(data) {
        Ok((names, _meta)) => names,
        Err(_) => vec!["q".to_string()],
    };
    for name in names.iter().take(8).map(String::as_str).chain(["no-such"]) {
        if let Ok(t) = parse_tensor_bytes(Format::Safetensors, data, name) {
            assert_eq!(t.data.len(), t.shape.iter().product::<usize>());
            assert!(t.data.len() <= data.len());
        }
        if let Ok(t) = parse_index_tensor_bytes(Format::Safetensors, data, name) {
            assert_eq!(t.data.len(), t.shape.iter().product::<usize>());
            assert!(t.data.len() <= data.len());
        }
    }
});
