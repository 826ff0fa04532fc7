//! Fuzzes the `.npy` reader of `pisa_cli::io` (float and index paths) with arbitrary bytes.
//! Contract: never panics, never allocates from an unchecked header value; on success the
//! tensor's element count equals the product of its shape.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pisa_cli::io::{parse_index_tensor_bytes, parse_tensor_bytes, Format};

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = parse_tensor_bytes(Format::Npy, data, "x") {
        assert_eq!(t.data.len(), t.shape.iter().product::<usize>());
        assert!(t.data.len() <= data.len());
    }
    if let Ok(t) = parse_index_tensor_bytes(Format::Npy, data, "x") {
        assert_eq!(t.data.len(), t.shape.iter().product::<usize>());
        assert!(t.data.len() <= data.len());
    }
});
