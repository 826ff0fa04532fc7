#![no_std]
//! PISA core.
