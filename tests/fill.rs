//! The GPU fill writes every element, stays in range, is not constant, and repeats per seed; its
//! bf16 values are its f32 values rounded to nearest even.
mod common;

use pisa_wgpu::ops::fill::random_tensor;
use pisa_wgpu::Storage;

#[test]
fn fill_writes_every_element_in_range() {
    let ctx = common::ctx();
    for (len, storage) in [
        (1usize, Storage::F32),
        (4099, Storage::F32),
        (100_003, Storage::F16),
        (7, Storage::Bf16),
        (4099, Storage::Bf16),
    ] {
        if storage == Storage::F16 && !ctx.has_f16() {
            // Refused with a typed error, not a pipeline that fails to build.
            let e = random_tensor(ctx, "a", len, storage, 7, 2.0).unwrap_err();
            assert!(matches!(e, pisa_wgpu::GpuError::Unsupported(_)), "{e}");
            continue;
        }
        let a = ctx
            .read_f32(&random_tensor(ctx, "a", len, storage, 7, 2.0).unwrap())
            .unwrap();
        let b = ctx
            .read_f32(&random_tensor(ctx, "b", len, storage, 7, 2.0).unwrap())
            .unwrap();
        let c = ctx
            .read_f32(&random_tensor(ctx, "c", len, storage, 8, 2.0).unwrap())
            .unwrap();
        assert!(
            a.iter().all(|x| x.is_finite() && (-2.0..=2.0).contains(x)),
            "unwritten or out of range"
        );
        assert_eq!(a, b, "same seed, same values");
        if storage == Storage::Bf16 {
            let f = random_tensor(ctx, "f", len, Storage::F32, 7, 2.0).unwrap();
            let want: Vec<f32> = (ctx.read_f32(&f).unwrap().iter())
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect();
            assert_eq!(a, want, "bf16 fill is the f32 fill rounded");
        }
        if len > 1 {
            assert_ne!(a, c, "different seed, different values");
            let mean = a.iter().map(|&x| x as f64).sum::<f64>() / len as f64;
            assert!(mean.abs() < 0.2, "mean {mean}");
        }
    }
}
