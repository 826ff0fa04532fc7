//! CPU reference of every PISA operation (feature `alloc`): straightforward loops, f64
//! accumulation, one function per operation. Everything on the GPU is tested against this.
