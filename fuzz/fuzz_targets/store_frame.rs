#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| burn_ddp_comm::fuzzing::store_frame(data));
